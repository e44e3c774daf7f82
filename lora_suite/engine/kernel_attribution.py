"""Profiled steps with their kernels' start and end, and the role of each GEMM of lora_core's LoRA layers.

``KernelRecorder`` is a ``DeviceTimer`` (its ``launches`` feed the step records as before) that also keeps each
profiled step's kernels as (name, start µs, end µs) and the profiler ranges the GPU saw (``ranges``).

``gemm_roles(rank)`` wraps lora_core's one GEMM entry point (``on_torch_stream.gemm``, through which its cuBLAS
path runs every GEMM) so that each call runs inside a profiler range named for its role, ``base GEMM`` or
``LoRA GEMM`` (``lora_suite.measure.kernel_profile.gemm_role``). The wrapper only opens a range around the same
call with the same arguments: what is computed does not change, and a captured replay does not run Python at all.
An implementation whose GEMMs do not go through that entry point (a peer on torch's GEMMs) has no role ranges: its
GEMMs are reported as not attributed, never guessed.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator

from lora_suite.measure.device_time import DeviceTimer, TimedLaunch, device_events
from lora_suite.measure.kernel_profile import gemm_role

ROLE_PREFIX = "lora_suite.role:"


class KernelRecorder(DeviceTimer):
    """A ``DeviceTimer`` that also keeps, per profiled step, its timed launches and the role ranges around them."""

    host_ranges = True  # the role ranges are opened by the host

    def __init__(self, steps: Iterable[int]):
        super().__init__(steps)
        self.timed: dict[int, list[TimedLaunch]] = {}
        self.ranges: dict[int, list[TimedLaunch]] = {}

    def keep(self, step: int, events) -> None:
        self.timed[step], self.ranges[step] = device_events(events, ROLE_PREFIX)
        self.launches[step] = [(name, end - start) for name, start, end in self.timed[step]]


@contextlib.contextmanager
def gemm_roles(rank: int) -> Iterator[bool]:
    """While open, each lora_core GEMM runs in a profiler range naming its role; yields whether lora_core's cuBLAS
    path could be wrapped (False where CuPy or its binding is missing: no GEMM is then lora_core's)."""
    try:
        from lora_core.ops.cupy_interop import on_torch_stream
    except ImportError:
        yield False
        return
    from torch.profiler import record_function

    original = on_torch_stream.gemm

    @functools.wraps(original)
    def gemm(self, out, a, b, *, trans_a=False, trans_b=False, **kwargs):
        k = a.shape[0] if trans_a else a.shape[1]
        with record_function(ROLE_PREFIX + gemm_role(out.shape[0], out.shape[1], k, rank)):
            return original(self, out, a, b, trans_a=trans_a, trans_b=trans_b, **kwargs)

    on_torch_stream.gemm = gemm  # type: ignore[method-assign]  # a deliberate patch of the method, undone below
    try:
        yield True
    finally:
        on_torch_stream.gemm = original  # type: ignore[method-assign]  # restores the method patched above
