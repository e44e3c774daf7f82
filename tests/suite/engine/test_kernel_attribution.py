"""GEMM role ranges around lora_core's GEMM entry point, and device events split into kernels and role ranges
(lora_suite/engine/kernel_attribution.py); on the CPU, with a stand-in for the cuBLAS call."""

from __future__ import annotations

import types

import pytest
import torch

from lora_suite.engine.kernel_attribution import ROLE_PREFIX, KernelRecorder, gemm_roles, split_device_events

cupy_interop = pytest.importorskip("lora_core.ops.cupy_interop")


def test_each_gemm_runs_inside_a_range_naming_its_role_and_the_entry_point_is_restored(monkeypatch):
    calls = []
    monkeypatch.setattr(cupy_interop.on_torch_stream, "gemm", lambda self, out, a, b, **kw: calls.append(kw) or out)
    stand_in = cupy_interop.on_torch_stream.gemm
    x, w, a_lora = torch.zeros(16, 64), torch.zeros(64, 64), torch.zeros(2, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with gemm_roles(2) as wrapped:
            assert wrapped
            ctx = object.__new__(cupy_interop.on_torch_stream)
            ctx.gemm(torch.zeros(16, 64), x, w, trans_b=True)
            ctx.gemm(torch.zeros(16, 2), x, a_lora, trans_b=True, alpha=0.5)
    assert cupy_interop.on_torch_stream.gemm is stand_in
    assert calls == [{"trans_a": False, "trans_b": True}, {"trans_a": False, "trans_b": True, "alpha": 0.5}]
    names = [e.name for e in prof.events() if e.name.startswith(ROLE_PREFIX)]
    assert names == [ROLE_PREFIX + "base GEMM", ROLE_PREFIX + "LoRA GEMM"]


def event(name, start, end, device="CUDA", annotation=False):
    return types.SimpleNamespace(
        name=name,
        device_type=types.SimpleNamespace(name=device),
        time_range=types.SimpleNamespace(start=start, end=end),
        is_user_annotation=annotation,
    )


def test_device_events_split_into_kernels_and_role_ranges_in_start_order():
    events = [
        event("k2", 5, 7),
        event(ROLE_PREFIX + "LoRA GEMM", 0, 4, annotation=True),
        event("k1", 0, 4),
        event("aten::mm", 0, 9, device="CPU"),
        event("some other range", 0, 9, annotation=True),
    ]
    kernels, ranges = split_device_events(events)
    assert kernels == [("k1", 0.0, 4.0), ("k2", 5.0, 7.0)]
    assert ranges == [("LoRA GEMM", 0.0, 4.0)]


def test_the_recorder_profiles_only_its_steps_and_only_on_a_gpu():
    recorder = KernelRecorder([3])
    with recorder.measure(3, cuda=False), recorder.measure(4, cuda=True):
        pass
    assert recorder.timed == {} and recorder.launches == {}
