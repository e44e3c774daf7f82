"""A planted slowdown of the full tier's training step, for the nightly gate on the tiers' headline figures (issue 43).

``--lora-impl lora_suite.scenarios.full_tier_step_slowdown:cupy_slowed`` is lora_core's cupy implementation,
reported under the same name (``compare`` only compares runs of one implementation), each decoder layer it adapts
spinning the GPU for ``SPIN_MS`` before its forward (``lora_suite.scenarios.gpu_spin``). The spin is a kernel: a
captured step records it in its CUDA graph and replays it. Llama-2-7B has 32 decoder layers and with activation
checkpointing each forward runs twice a step (the forward, and the recompute in the backward), so the full tier's
captured step gets 64 x 0.2 = 12.8 ms more device time: about 18% of the 72.7 ms it took on an H100 (run
20261126T061828Z-full), 26% of the 49.5 ms on an H200. Its test: selftest-gpu's
``test_planted_full_tier_step_slowdown.py``. Until issue 58 this module was ``lora_suite.scenarios.step_slowdown``
(the runs of that time carry that name).

A first version spun in the first adapted layer only: the full tier's 16-bit-base comparison builds a model first,
so that layer was in a model the tier then discarded, and the planted run's step was the clean one's (72.67 vs
72.70 ms, runs 20261126T062015Z-full-lora_suite_scenarios_step_slowdown_cupy_slowed and 20261126T061828Z-full).
"""

from __future__ import annotations

from lora_suite.implementations.lora_core_impl import LoraCoreImplementation
from lora_suite.scenarios.gpu_spin import cycles_per_ms, spin

SPIN_MS = 0.2


class SlowedCupy(LoraCoreImplementation):
    """cupy, with ``SPIN_MS`` of GPU spin before each forward of every decoder layer it adapts."""

    def __init__(self) -> None:
        super().__init__("cupy")
        self._cycles: int | None = None

    def describe(self) -> str:
        return super().describe() + f" [planted: {SPIN_MS} ms of GPU spin before each adapted layer's forward]"

    def inject(self, model, spec):
        adapted = super().inject(model, spec)
        if adapted:  # lora_core injects decoder layer by layer: ``model`` is one
            if self._cycles is None:
                self._cycles = int(SPIN_MS * cycles_per_ms())
            cycles = self._cycles
            model.register_forward_pre_hook(lambda module, args: spin(cycles))
        return adapted


def cupy_slowed() -> SlowedCupy:
    return SlowedCupy()
