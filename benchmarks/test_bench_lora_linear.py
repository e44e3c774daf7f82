"""pytest-benchmark suite: forward+backward of one LoRA linear layer in bf16, against the frozen base.

Rows per shape, in this order: the frozen base layer alone (x Wᵀ and dx), the torch reference backend,
PEFT's LoRA Linear (when peft imports) and the cupy backend. Each timed call ends with a device
synchronisation, so pytest-benchmark's host timer sees the GPU time; the row's ``extra_info`` also holds
CUDA-event statistics (median, p20, p80 of 50 reps after 10 warm-ups) and ``ratio_to_base``, the
CUDA-event median over the base layer's, measured in the same run. Adapters are bf16 on every row.

Run: ``./scripts/gpu-test.sh bench`` (or ``pytest benchmarks -m benchmark --benchmark-json=...``).
"""

from __future__ import annotations

import pytest
import torch

import lora_core
from lora_core.timing import cuda_time

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark]

DEV, DT = "cuda", torch.bfloat16
SHAPES = {  # id: (batch, seq, in, out, r)
    "tiny-1tok-64to64-r8": (1, 1, 64, 64, 8),  # launch-bound: shows the host cost per call
    "seed-4x512-h768-r16": (4, 512, 768, 768, 16),
    "seed-8x256-h1024-r32": (8, 256, 1024, 1024, 32),
    "seed-2x1024-h2048-r16": (2, 1024, 2048, 2048, 16),
    "llama7b-8192tok-4096to4096-r16": (1, 8192, 4096, 4096, 16),
    "llama7b-8192tok-4096to11008-r16": (1, 8192, 4096, 11008, 16),
    "llama7b-8192tok-11008to4096-r16": (1, 8192, 11008, 4096, 16),
}
IMPLS = ("base", "torch", "peft", "cupy", "cupy-nf4")  # cupy-nf4: the same layer over an NF4 base (QLoRA)
CASES = [(shape, impl) for shape in SHAPES for impl in IMPLS  # base first within each shape
         if impl != "cupy-nf4" or shape.startswith("llama7b")]
_base_ms: dict[str, float] = {}
_ratios: dict[tuple[str, str], float] = {}


def _make_step(impl: str, batch: int, seq: int, k: int, o: int, r: int):
    """A closure doing one forward+backward; inputs are built once, outside the timing."""
    linear = torch.nn.Linear(k, o, bias=False, device=DEV, dtype=DT).requires_grad_(False)
    x = torch.randn(batch, seq, k, device=DEV, dtype=DT, requires_grad=True)
    dy = torch.randn(batch, seq, o, device=DEV, dtype=DT)
    if impl == "base":
        def step():
            return torch.autograd.grad(linear(x), (x,), dy)
        return step
    if impl == "peft":
        peft = pytest.importorskip("peft", reason="peft is not installed: no PEFT row")
        model = peft.get_peft_model(torch.nn.Sequential(linear),
                                    peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["0"], lora_dropout=0.0),
                                    autocast_adapter_dtype=False)
        layer = model.base_model.model[0]
        params = (x, layer.lora_A["default"].weight, layer.lora_B["default"].weight)
        torch.nn.init.normal_(params[2], std=0.02)
    else:
        quantize = "nf4" if impl == "cupy-nf4" else None
        layer = lora_core.LoRALinear.from_linear(linear, r=r, alpha=2 * r, backend=impl.split("-")[0],
                                                 adapter_dtype=DT, quantize=quantize)
        torch.nn.init.normal_(layer.lora_B, std=0.02)
        params = (x, layer.lora_A, layer.lora_B)
    assert all(p.dtype == DT for p in params[1:]), "every row runs bf16 adapters"

    def step():
        return torch.autograd.grad(layer(x), params, dy)
    return step


@pytest.mark.parametrize("shape,impl", CASES, ids=[f"{s}-{i}" for s, i in CASES])
def test_forward_backward(benchmark, shape, impl, check, run_report):
    batch, seq, k, o, r = SHAPES[shape]
    step = _make_step(impl, batch, seq, k, o, r)

    def synced_step():
        step()
        torch.cuda.synchronize()

    stats = cuda_time(step, warmup=10, reps=50)
    benchmark.pedantic(synced_step, rounds=30, iterations=1, warmup_rounds=3)
    benchmark.group = shape
    info = {"shape": shape, "impl": impl, "tokens": batch * seq, "in": k, "out": o, "r": r, "dtype": "bf16",
            "cuda_median_ms": stats.median_ms, "cuda_p20_ms": stats.p20_ms, "cuda_p80_ms": stats.p80_ms}
    if impl == "base":
        _base_ms[shape] = stats.median_ms
    if shape in _base_ms:
        info["ratio_to_base"] = stats.median_ms / _base_ms[shape]
        _ratios[(shape, impl)] = info["ratio_to_base"]
    benchmark.extra_info.update(info)
    run_report.add_row("benchmarks", "forward+backward, bf16 (CUDA events, 50 reps)",
                       ("shape", "impl", "median ms", "p20 ms", "p80 ms", "ratio to base"),
                       (shape, impl, stats.median_ms, stats.p20_ms, stats.p80_ms, info.get("ratio_to_base")))
    if impl == "cupy" and shape.startswith("llama7b") and (shape, "peft") in _ratios:
        check(f"{shape}: cupy ratio to base <= PEFT's", round(_ratios[(shape, "cupy")], 4), "<=",
              round(_ratios[(shape, "peft")], 4), source="issue bar: no worse than PEFT, same run")
