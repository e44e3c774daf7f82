"""A planted slowdown of the system under test, for the nightly gate on the tiers' headline figures (issue 43).

``--lora-impl lora_suite.scenarios.step_slowdown:cupy_slowed`` is lora_core's cupy implementation, reported under the
same name (``compare`` only compares runs of one implementation), whose first adapted decoder layer spins the GPU
for ``SPIN_MS`` before each forward (``torch.cuda._sleep``, cycles measured against CUDA events once). The spin is a
kernel: a captured step records it in its CUDA graph and replays it. With activation checkpointing the layer's
forward runs twice a step (the forward, and the recompute in the backward), so the full tier's captured 7B QLoRA
step (about 50-55 ms on an H200 or an H100) gets about 2 x 5.5 = 11 ms more device time: about 20%.
"""

from __future__ import annotations

import torch

from lora_suite.implementations.lora_core_impl import LoraCoreImplementation

SPIN_MS = 5.5


def cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep``, timed with CUDA events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm
    a.record()
    torch.cuda._sleep(10_000_000)
    b.record()
    b.synchronize()
    return 10_000_000 / a.elapsed_time(b)


class SlowedCupy(LoraCoreImplementation):
    """cupy, with ``SPIN_MS`` of GPU spin before each forward of the first decoder layer it adapts."""

    def __init__(self):
        super().__init__("cupy")
        self._cycles: int | None = None

    def describe(self) -> str:
        return super().describe() + f" [planted: {SPIN_MS} ms of GPU spin per forward of its first adapted layer]"

    def inject(self, model, spec):
        adapted = super().inject(model, spec)
        if self._cycles is None and adapted:  # the first layer (lora_core injects decoder layer by layer)
            self._cycles = int(SPIN_MS * cycles_per_ms())
            model.register_forward_pre_hook(lambda module, args: torch.cuda._sleep(self._cycles))
        return adapted


def cupy_slowed() -> SlowedCupy:
    return SlowedCupy()
