"""NF4 speed: dequantisation bandwidth against a device-to-device copy measured in the same run.

Bandwidth counts bytes read plus bytes written: for the copy 2·size; for the dequantisation the packed
codes (n/2), the absmax codes (n/64) and scales, and the 16-bit output (2n).
"""

from __future__ import annotations

import pytest
import torch

from lora_core.nf4 import dequantize_nf4, quantize_nf4
from lora_core.timing import cuda_time

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark]

_copy_gbs: dict[str, float] = {}
MIN_FRACTION_OF_COPY = 0.70  # the QLoRA issue's bar


def test_device_copy_bandwidth(benchmark, run_report):
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    stats = cuda_time(lambda: dst.copy_(src), warmup=5, reps=30)
    benchmark.pedantic(lambda: (dst.copy_(src), torch.cuda.synchronize()), rounds=10, iterations=1)
    _copy_gbs["copy"] = 2 * src.numel() / (stats.median_ms * 1e-3) / 1e9
    benchmark.extra_info.update({"gb_per_s": _copy_gbs["copy"], "cuda_median_ms": stats.median_ms})
    run_report.add_row("benchmarks", "NF4 dequantisation bandwidth (bytes read + written)",
                       ("kernel", "shape", "median ms", "GB/s", "fraction of copy"),
                       ("device copy 1 GiB", "-", stats.median_ms, _copy_gbs["copy"], 1.0))


@pytest.mark.parametrize("shape", [(11008, 4096), (16384, 16384)], ids=["llama7b-mlp", "16k-square"])
def test_dequant_bandwidth(benchmark, shape, run_report, check):
    if "copy" not in _copy_gbs:
        pytest.skip("the copy baseline did not run")
    q = quantize_nf4((torch.randn(*shape, device="cuda") * 0.02).bfloat16())
    out = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    stats = cuda_time(lambda: dequantize_nf4(q, out=out), warmup=5, reps=50)
    benchmark.pedantic(lambda: (dequantize_nf4(q, out=out), torch.cuda.synchronize()), rounds=10, iterations=1)
    moved = q.nbytes() + out.numel() * out.element_size()
    gbs = moved / (stats.median_ms * 1e-3) / 1e9
    fraction = gbs / _copy_gbs["copy"]
    benchmark.extra_info.update({"gb_per_s": gbs, "fraction_of_copy": fraction, "cuda_median_ms": stats.median_ms})
    run_report.add_row("benchmarks", "NF4 dequantisation bandwidth (bytes read + written)",
                       ("kernel", "shape", "median ms", "GB/s", "fraction of copy"),
                       ("nf4_dequantize -> bf16", "x".join(map(str, shape)), stats.median_ms, gbs, fraction))
    check(f"dequant {shape} bandwidth / device copy", round(fraction, 3), ">=", MIN_FRACTION_OF_COPY,
          source="QLoRA issue bar: >= 70% of a device-to-device copy, same run")
