"""The planted defects that are pytest plugins (``-p lora_suite.scenarios.<module>``) on the CPU: each replaces what it
says in ``pytest_configure`` and nothing else, and selftest-gpu's folder holds tests only (every plant lives in
``lora_suite/scenarios/`` and is loaded by module name, never from a folder put on ``PYTHONPATH``)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lora_core.ops import fused_engine
from lora_suite.engine import benchmarking
from lora_suite.scenarios import bench_cupy_rows_slowdown as bench_plant
from lora_suite.scenarios import swiglu_wrong_variant as swiglu_plant

ROOT = Path(__file__).resolve().parents[3]
SELFTEST_GPU = ROOT / "lora_suite" / "tiers" / "selftest_gpu"
PLUGINS = ("lora_suite.scenarios.bench_cupy_rows_slowdown", "lora_suite.scenarios.swiglu_wrong_variant")


def test_selftest_gpu_holds_tests_only_and_the_plugin_plants_load_by_module_name():
    modules = sorted(p.name for p in SELFTEST_GPU.glob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if not m.startswith("test_")] == []
    for name in PLUGINS:
        assert callable(importlib.import_module(name).pytest_configure), name


def test_the_swiglu_plant_takes_vectors_whenever_four_divide_i(monkeypatch):
    monkeypatch.setattr(fused_engine, "_swiglu_vec", fused_engine._swiglu_vec)
    right = fused_engine._swiglu_vec
    swiglu_plant.pytest_configure(None)
    assert fused_engine._swiglu_vec is swiglu_plant.vectors_whenever_four_divide
    for dtype in (torch.bfloat16, torch.float16):  # I = 1028: 4 divides it, the vector width 8 does not
        assert (right(dtype, 1028), fused_engine._swiglu_vec(dtype, 1028)) == (1, 8)
        assert right(dtype, 1032) == fused_engine._swiglu_vec(dtype, 1032) == 8
    assert right(torch.float32, 1028) == fused_engine._swiglu_vec(torch.float32, 1028) == 4  # fp32: the same rule


def _fake_real(impl, *args, **kw):
    return lambda: f"{impl} step"


def test_the_bench_plant_appends_a_spin_of_a_fifth_of_the_step_to_the_cupy_rows_only(monkeypatch):
    """The spin's cycles, from the step's 5 ms and 1000 cycles/ms: 1000; the slowed step then reads 5.6 ms (the
    clock under load differs), so the cycles are scaled once by 1.0 ms wanted / 0.6 ms added: 1666."""
    spins: list[int] = []
    times = iter([5.0, 5.6] * 2)

    def cuda_time(step, warmup, reps):
        step()
        return SimpleNamespace(median_ms=next(times))

    monkeypatch.setattr(benchmarking, "layer_step", _fake_real)
    monkeypatch.setattr(bench_plant, "cuda_time", cuda_time)
    monkeypatch.setattr(bench_plant, "cycles_per_ms", lambda: 1000.0)
    monkeypatch.setattr(bench_plant, "spin", spins.append)
    bench_plant.pytest_configure(None)
    slowed = benchmarking.layer_step
    assert slowed is not _fake_real
    for impl in ("base", "torch", "peft"):
        assert slowed(impl, 1, 1, 8, 8, 4)() == f"{impl} step"
    assert spins == []
    for impl in ("cupy", "cupy-nf4"):
        assert slowed(impl, 1, 1, 8, 8, 4)() == f"{impl} step"
    assert spins == [1000, 1666] * 2  # the calibration's call, then the corrected spin


@pytest.mark.parametrize("plant", ["lora_suite.scenarios.full_tier_step_slowdown:cupy_slowed"])
def test_the_full_tier_plant_is_a_wrapping_implementation_spec(plant):
    module, factory = plant.split(":")
    impl = getattr(importlib.import_module(module), factory)()
    assert impl.name == "cupy" and "planted" in impl.describe()
