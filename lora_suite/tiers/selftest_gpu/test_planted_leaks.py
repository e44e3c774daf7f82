"""selftest-gpu, memory kept per step: each test plants a leak (a monkeypatch-free step hook, never shipped code) in
the extended configuration's run and asserts that the extended tier's leak criterion for that memory fails.

The run and the assertion are test_planted_defects.py's (``_extended_run``, ``_assert_fails``), loaded by path (test
modules are not a package).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_suite.harness.modules import load_test_module

pytestmark = [pytest.mark.gpu, pytest.mark.selftest_gpu]
_runs = load_test_module(Path(__file__).resolve().parent / "test_planted_defects.py", "planted_defects_runs")
_extended_run, _assert_fails = _runs._extended_run, _runs._assert_fails


def test_a_leak_is_caught(tier):
    """2 MiB of GPU memory kept per step in torch's allocator: torch's allocated memory fails. This process's GPU
    memory is recorded beside it, not asserted: it includes the caching allocator's reserve, which served the 100
    leaked MiB without growing (H100, 243680f: 7836 MiB flat), so a leak smaller than the reserve is torch's
    allocated series' to catch, and memory outside torch's allocator the process series' (the next plant)."""
    kept = []

    def leak(step):  # one (512, 2048) bf16 activation kept per step: 2 MiB/step
        kept.append(torch.empty(512, 2048, dtype=torch.bfloat16, device="cuda"))

    verdicts = _extended_run(tier, step_hook=leak)
    _assert_fails(tier, "leak of 2 MiB/step", verdicts["allocated_mib"])
    own = verdicts["process_gpu_mib"]
    tier.report.notes.append(f"{tier.nodeid}: process_gpu_mib under the same plant (not asserted): {own.detail}")


def test_a_leak_outside_torchs_allocator_is_caught(tier):
    """2 MiB kept per step in CuPy's own pool (lora_core never uses it: scratch kept by a RawKernel path would land
    there): torch's allocator does not see it, this process's GPU memory does."""
    cupy = pytest.importorskip("cupy", reason="the CuPy-pool plant needs CuPy")
    kept = []

    def leak(step):
        kept.append(cupy.empty(1 << 20, dtype=cupy.uint16))

    verdicts = _extended_run(tier, step_hook=leak)
    _assert_fails(tier, "leak of 2 MiB/step in CuPy's pool", verdicts["process_gpu_mib"])
    tier.check(
        "planted CuPy-pool leak: torch's allocated memory does not see it (why process memory is judged)",
        verdicts["allocated_mib"].passed,
        "==",
        True,
        detail=verdicts["allocated_mib"].detail,
    )
    kept.clear()
    cupy.get_default_memory_pool().free_all_blocks()


def test_a_host_leak_is_caught(tier, plant_round):
    """Plant (c) of issue 18: ~1 MiB of host memory kept per step (a per-step Python object never released)."""
    kept = []

    def leak(step):
        kept.append(bytearray(1 << 20))  # zero-filled: its pages are resident

    _assert_fails(tier, "host leak of 1 MiB/step", _extended_run(tier, step_hook=leak)["host_heap_mib"])
