"""lora_suite.engine.benchmarking on the CPU: the kernel profile read off a (fake) torch.profiler session."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lora_suite.engine.benchmarking import kernel_profile, op_profile


def _event(key, device, count, us):
    return SimpleNamespace(key=key, device_type=SimpleNamespace(name=device), count=count, self_device_time_total=us)


def test_kernel_profile_keeps_cuda_kernels_per_call_most_time_first():
    prof = SimpleNamespace(
        key_averages=lambda: [
            _event("gemm", "CUDA", 4, 2000.0),
            _event("cast", "CUDA", 2, 100.0),
            _event("aten::mm", "CPU", 4, 0.0),
            _event("idle", "CUDA", 1, 0.0),
            _event("elementwise", "CUDA", 8, 3000.0),
        ]
    )
    total, kernels = kernel_profile(prof, calls=2)
    assert [k.name for k in kernels] == ["elementwise", "gemm", "cast"]  # CPU and zero-time events left out
    assert [k.launches for k in kernels] == [4, 2, 1]
    assert [k.ms for k in kernels] == pytest.approx([1.5, 1.0, 0.05])
    assert total == pytest.approx(2.55)


def test_op_profile_names_the_host_ops_by_their_own_device_time():
    prof = SimpleNamespace(
        key_averages=lambda: [
            _event("aten::mul", "CPU", 6, 900.0),
            _event("aten::linear", "CPU", 4, 0.0),  # its time is its child aten::mm's
            _event("aten::mm", "CPU", 4, 2000.0),
            _event("gemm", "CUDA", 4, 2000.0),
        ]
    )
    ops = op_profile(prof, calls=2)
    assert [o.name for o in ops] == ["aten::mm", "aten::mul"]  # kernels and ops without own device time left out
    assert [o.calls for o in ops] == [2, 3]
    assert [o.ms for o in ops] == pytest.approx([1.0, 0.45])
