"""A planted 20% slowdown of the layer benchmark's cupy rows, for the regression gate on benchmark rows: a pytest
plugin, never shipped code.

    lora-suite bench -- -p lora_suite.scenarios.bench_cupy_rows_slowdown

Every cupy and cupy-nf4 layer step (``lora_suite.engine.benchmarking.layer_step``, which the rows of
``lora_suite/benchmarks/test_bench_lora_linear.py`` time) gets a GPU spin (``lora_suite.scenarios.gpu_spin``) of
``SLOWDOWN`` x its own median CUDA time appended: t' = t (1 + SLOWDOWN). ``compare`` of such a run against a clean
one must exit 1 naming those rows; its test: selftest-gpu's ``test_planted_bench_cupy_rows_slowdown.py``. Until
issue 58 this was ``tiers/selftest_gpu/planted_slowdown.py``, loaded from that folder through ``PYTHONPATH``.
"""

from __future__ import annotations

from collections.abc import Callable

from lora_suite.engine import benchmarking
from lora_suite.measure.timing import cuda_time
from lora_suite.scenarios.gpu_spin import cycles_per_ms, spin

SLOWDOWN = 0.20


def slowed(real: Callable[..., Callable[[], object]]) -> Callable[..., Callable[[], object]]:
    """``layer_step`` with the spin appended to its cupy rows' steps; the other rows' steps are ``real``'s."""

    def layer_step(impl: str, *args, **kw) -> Callable[[], object]:
        step = real(impl, *args, **kw)
        if not impl.startswith("cupy"):
            return step
        base = cuda_time(step, warmup=5, reps=20).median_ms
        cycles = [int(SLOWDOWN * base * cycles_per_ms())]

        def slow_step() -> object:
            out = step()
            spin(cycles[0])
            return out

        # One correction, so that the slowed step takes (1 + SLOWDOWN) x its own time as measured: a spin of the
        # cycles timed alone added 12-17% to these rows, not 20% (run 20261128T061757Z-selftest-gpu), the clock
        # under the benchmark's load differing from the clock the spin was timed at.
        added = cuda_time(slow_step, warmup=5, reps=20).median_ms - base
        if added > 0:
            cycles[0] = int(cycles[0] * SLOWDOWN * base / added)
        return slow_step

    return layer_step


def pytest_configure(config) -> None:
    """Before the benchmark modules are collected (they import ``layer_step`` by name), so they get the slowed one."""
    benchmarking.layer_step = slowed(benchmarking.layer_step)
