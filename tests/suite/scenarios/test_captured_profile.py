"""The captured step's profile (lora_suite.scenarios.captured_profile) on the CPU: the graph pool is read from the
allocator's private segments only, the replays fit inside the run, eager and captured profiles are compared kind by
kind and kernel by kernel with the largest difference first, and the memory reading names the phase that makes the
peak."""

from __future__ import annotations

import math
import types

import pytest

from lora_suite.engine.benchmarking import KernelTime
from lora_suite.scenarios import captured_profile as CP
from lora_suite.scenarios import step_profile as SP

GIB = CP.GIB


def _profile(kinds: dict[str, float], kernels: list[KernelTime]) -> SP.StepProfile:
    return SP.StepProfile(sum(kinds.values()), kinds, kernels, [], 1.0, 1.0, ())


def test_graph_pool_bytes_counts_private_pools_only():
    segments = [
        {"segment_pool_id": (0, 0), "total_size": 100, "allocated_size": 60},
        {"segment_pool_id": (1, 0), "total_size": 40, "allocated_size": 10},
        {"segment_pool_id": [2, 0], "total_size": 8, "allocated_size": 8},  # a list, as a JSON trip leaves it
        {"total_size": 1000, "allocated_size": 1000},  # no pool id: the default pool
    ]
    assert CP.graph_pool_bytes(segments) == (48, 18)
    assert CP.graph_pool_bytes([]) == (0, 0)


def test_replay_steps_follow_the_capture_inside_the_run():
    timed, profiled = CP.replay_steps(capture_at=3, steps=3, total=25)
    assert list(timed) == [4, 5, 6] and list(profiled) == [7, 8, 9]
    assert list(CP.replay_steps(3, 2, 8)[1]) == [6, 7]
    with pytest.raises(ValueError, match=r"steps=3.*6 replays.*step 3.*8 steps"):
        CP.replay_steps(3, 3, 8)
    with pytest.raises(ValueError, match="steps=0"):
        CP.replay_steps(3, 0, 25)


def test_kind_differences_put_the_largest_difference_first():
    eager = _profile({"GEMM": 100.0, "Liger": 10.0, "other": 30.0}, [])
    captured = _profile({"GEMM": 101.0, "LoRA loss": 12.0, "other": 50.0}, [])
    rows = CP.kind_differences(eager, captured)
    assert rows[0] == ("other", 30.0, 50.0, 20.0)
    assert rows[1] == ("LoRA loss", 0.0, 12.0, 12.0)
    assert rows[2] == ("Liger", 10.0, 0.0, -10.0)
    assert rows[3][0] == "GEMM" and math.isclose(rows[3][3], 1.0)


def test_kernel_differences_count_a_missing_kernel_as_zero():
    eager = _profile({}, [KernelTime("gemm_a", 10, 5.0), KernelTime("liger_ce", 2, 3.0), KernelTime("same", 1, 1.0)])
    captured = _profile({}, [KernelTime("gemm_a", 10, 9.0), KernelTime("cross_entropy_rows<", 4, 2.0)])
    rows = CP.kernel_differences(eager, captured, top=3)
    assert rows[0] == ("gemm_a", 10, 5.0, 10, 9.0, 4.0)
    assert rows[1] == ("liger_ce", 2, 3.0, 0.0, 0.0, -3.0)
    assert rows[2] == ("cross_entropy_rows<", 0.0, 0.0, 4, 2.0, 2.0)


@pytest.mark.parametrize(
    "warm,capture,expect",
    [
        (10, 14, "made in the capture"),
        (14, 10, "made in the eager warm-up"),
        (10, 10.05, "no heavier than the eager step"),
    ],
)
def test_memory_reading_names_the_phase_of_the_peak(warm, capture, expect):
    phases = CP.MemoryPhases(int(warm * GIB), int(6 * GIB), int(capture * GIB), int(5 * GIB), int(GIB))
    reading = CP.memory_reading(int(10 * GIB), phases)
    assert expect in reading
    if "above" in reading:
        assert "4.000 GiB above" in reading and "6.000 GiB allocated" in reading and "pool 5.000 GiB" in reading
    assert phases.gib()["pool_allocated"] == 1.0


def test_finite_losses():
    assert CP.finite_losses([1.0, 2.0])
    assert not CP.finite_losses([1.0, math.nan])
    assert not CP.finite_losses([math.inf])
    assert not CP.finite_losses([])


def test_profile_captured_refuses_an_eager_config():
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(cuda_graph=False, steps=25))
    with pytest.raises(ValueError, match="train.cuda_graph: true"):
        CP.profile_captured(None, cfg, None)


def test_a_replay_without_spans_is_refused():
    with pytest.raises(RuntimeError, match="no CUDA-event span"):
        CP._median_ms([None, None])
    assert CP._median_ms([0.001, 0.003, 0.002]) == pytest.approx(2.0)
    assert CP._median_ms([0.001, 0.002]) == pytest.approx(1.5)
