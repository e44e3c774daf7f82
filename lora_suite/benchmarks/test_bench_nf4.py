"""NF4 speed: dequantisation bandwidth against a device-to-device copy of the same bytes, in the same run.

Bytes moved count reads plus writes: the packed codes (n/2), the absmax codes and scales, and the 16-bit
output (2n); the copy moves the same number (lora_suite/engine/benchmarking.py says why the same size). The bar
(>= 70% of copy) is judged on per-round fractions, with a noise allowance of NOISE_Z standard errors and
up to three measurements before it fails (lora_suite/measure/timing.py measure_until_pass).
"""

from __future__ import annotations

import pytest
import torch

from lora_core.nf4 import dequantize_nf4, quantize_nf4
from lora_suite.engine.benchmarking import NOISE_Z, dequant_vs_copy
from lora_suite.measure.timing import measure_until_pass

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.benchmark,
    pytest.mark.needs_feature("lora_core_ops"),
]  # lora_core's NF4 kernels

MIN_FRACTION_OF_COPY = 0.70  # the QLoRA issue's bar
TABLE = (
    "NF4 dequantisation bandwidth / copy of the same bytes (per-round medians)",
    ("shape", "attempt", "median fraction", "SE", "bar - z*SE", "verdict", "MB moved"),
)


def dequant_bar_attempts(shape, dequant=dequantize_nf4):
    moved = {}

    def measure():
        est, moved["bytes"] = dequant_vs_copy(shape, dequant=dequant)
        return est

    attempts = measure_until_pass(measure, lambda e: e.median + NOISE_Z * e.se >= MIN_FRACTION_OF_COPY)
    return attempts, moved["bytes"]


@pytest.mark.parametrize("shape", [(11008, 4096), (16384, 16384)], ids=["llama7b-mlp", "16k-square"])
def test_dequant_bandwidth(benchmark, shape, run_report, check):
    q = quantize_nf4((torch.randn(*shape, device="cuda") * 0.02).bfloat16())
    out = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    benchmark.group = "nf4-dequant"

    def dequantise_and_wait() -> None:
        dequantize_nf4(q, out=out)
        torch.cuda.synchronize()

    benchmark.pedantic(dequantise_and_wait, rounds=10, iterations=1)
    attempts, moved = dequant_bar_attempts(shape)
    name = "x".join(map(str, shape))
    for i, a in enumerate(attempts):
        run_report.add_row(
            "benchmarks",
            TABLE[0],
            TABLE[1],
            (
                name,
                i + 1,
                a.estimate.median,
                a.estimate.se,
                MIN_FRACTION_OF_COPY - NOISE_Z * a.estimate.se,
                "pass" if a.passed else "FAIL",
                moved / 1e6,
            ),
        )
    last = attempts[-1].estimate
    benchmark.extra_info.update(
        {"fraction_of_copy": last.median, "fraction_se": last.se, "attempts": len(attempts), "bytes_moved": moved}
    )
    # The name stays the same from run to run (the regression gate matches checks by name); attempts go in detail.
    check(
        f"dequant {shape}: bandwidth / copy of the same bytes, + {NOISE_Z} SE (best attempt)",
        round(max(a.estimate.median + NOISE_Z * a.estimate.se for a in attempts), 3),
        ">=",
        MIN_FRACTION_OF_COPY,
        source="QLoRA issue bar: >= 70% of a device-to-device copy, same run; allowance lora_suite/engine/benchmarking.py; "
        "noise model: dequantisation and a copy of the same bytes timed in turns (7 rounds, CUDA events), 3 SE "
        "of the per-round fractions, up to 3 attempts",
        detail=f"{len(attempts)} attempt(s), medians {[round(a.estimate.median, 3) for a in attempts]}",
    )
