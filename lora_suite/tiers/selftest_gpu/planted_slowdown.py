"""A pytest plugin that plants a 20% slowdown in the cupy rows of the benchmarks (never shipped code).

    PYTHONPATH=.:tiers/selftest_gpu ./scripts/gpu-test.sh bench -- -p planted_slowdown

Every cupy / cupy-nf4 layer step gets a GPU spin (``torch.cuda._sleep``) of 20% of its own median CUDA time
appended; ``./scripts/gpu-test.sh compare`` of such a run against a clean one must exit 1 and name those rows.
"""

from __future__ import annotations

import torch

from lora_suite.engine import benchmarking
from lora_suite.measure.timing import cuda_time
from lora_suite.scenarios.step_slowdown import cycles_per_ms

SLOWDOWN = 0.20


def pytest_configure(config):
    real = benchmarking.layer_step

    def slowed(impl, *args, **kw):
        step = real(impl, *args, **kw)
        if not impl.startswith("cupy"):
            return step
        cycles = int(SLOWDOWN * cuda_time(step, warmup=5, reps=20).median_ms * cycles_per_ms())

        def slow_step():
            out = step()
            torch.cuda._sleep(cycles)
            return out

        return slow_step

    benchmarking.layer_step = slowed
