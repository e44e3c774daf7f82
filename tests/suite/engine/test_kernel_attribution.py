"""GEMM role ranges around lora_core's GEMM entry point, and the recorder that keeps them
(lora_suite/engine/kernel_attribution.py); on the CPU, with a stand-in for the cuBLAS call."""

from __future__ import annotations

import pytest
import torch

from lora_suite.engine.kernel_attribution import ROLE_PREFIX, KernelRecorder, gemm_roles

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


def test_the_recorder_profiles_only_its_steps_and_only_on_a_gpu():
    recorder = KernelRecorder([3])
    with recorder.measure(3, cuda=False), recorder.measure(4, cuda=True):
        pass
    assert recorder.timed == {} and recorder.launches == {}
