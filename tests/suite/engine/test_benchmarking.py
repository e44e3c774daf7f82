"""lora_suite.engine.benchmarking on the CPU: the kernel profile read off a (fake) torch.profiler session."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lora_suite.engine.benchmarking import host_calls, kernel_profile, op_profile


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


def test_host_calls_are_the_cuda_runtime_and_driver_calls_by_their_own_host_time():
    def cpu(key, count, us):
        return SimpleNamespace(key=key, device_type=SimpleNamespace(name="CPU"), count=count, self_cpu_time_total=us)

    prof = SimpleNamespace(
        key_averages=lambda: [
            cpu("cudaLaunchKernel", 400, 2000.0),
            cpu("cudaStreamSynchronize", 2, 9000.0),
            cpu("cuLaunchKernelEx", 100, 600.0),
            cpu("aten::mm", 40, 5000.0),  # an op, not a runtime call
            cpu("cudnn_convolution", 2, 700.0),  # a cuDNN-backed op: no capital after the prefix
            cpu("cudaFree", 1, 0.0),  # no host time
            SimpleNamespace(
                key="cudaMemcpyAsync", device_type=SimpleNamespace(name="CUDA"), count=1, self_cpu_time_total=9.0
            ),
        ]
    )
    calls = host_calls(prof, calls=2)
    assert [c.name for c in calls] == ["cudaStreamSynchronize", "cudaLaunchKernel", "cuLaunchKernelEx"]
    assert [c.calls for c in calls] == [1, 200, 50]
    assert [c.ms for c in calls] == pytest.approx([4.5, 1.0, 0.3])
