"""lora_core's NF4 against bitsandbytes' (issue 19), at the Llama-7B shapes: the same weights, each side's own
kernels, timed in turns.

- ``test_dequant_vs_bitsandbytes``: a bf16 weight quantised by bitsandbytes (nf4, block 64, double quant) is read
  into an NF4Tensor as it is (``lora_core.bnb_format.from_bnb``); lora_core's dequantisation must equal
  bitsandbytes' ``dequantize_4bit`` bit for bit (a check), and both are timed in turns over 7 rounds: the row is
  the per-round ratio bitsandbytes ms / lora_core ms (> 1: lora_core faster) with its SE. lora_core's own
  quantisation of the same weight (its linear double quantisation) is timed beside it.
- ``test_qlora_layer_vs_bitsandbytes``: forward+backward of one QLoRA layer, 8192 tokens, r 16, bf16 adapters:
  lora_core's LoRALinear on an NF4 base (cupy) against PEFT's LoRA on a bitsandbytes Linear4bit (peft-bnb, as
  QLoRA is run), each over the same weight, timed in turns; rows: ratio peft-bnb / cupy per round, and each
  side's extra peak memory over its inputs.
Rows, not bars: the issue sets no target. Skipped where bitsandbytes does not import (the lent GPU machines
need its wheel carried: only the library matching torch's CUDA is needed).
"""

from __future__ import annotations

import pytest
import torch

import lora_core
from lora_core.bnb_format import from_bnb
from lora_core.nf4 import dequantize_nf4, quantize_nf4
from lora_suite.timing import PairedEstimate, interleaved_rounds

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark]
bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: pip install lora-gpu-suite[peft-bnb]")

SHAPES = {"llama7b-4096to4096": (4096, 4096), "llama7b-4096to11008": (11008, 4096),
          "llama7b-11008to4096": (4096, 11008)}  # (out, in) of the weight
DT = torch.bfloat16


def _bnb_weight(out_f: int, in_f: int):
    """(bf16 weight, bitsandbytes packed codes, QuantState): nf4, block 64, double quant, as BitsAndBytesConfig."""
    import bitsandbytes.functional as F
    w = (torch.randn(out_f, in_f, device="cuda") * 0.02).to(DT)
    packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    return w, packed, state


@pytest.mark.parametrize("shape", list(SHAPES))
def test_dequant_vs_bitsandbytes(shape, run_report, check):
    import bitsandbytes.functional as F
    w, packed, state = _bnb_weight(*SHAPES[shape])
    ours = from_bnb(packed, state)
    theirs = F.dequantize_4bit(packed, state)
    differing = int((dequantize_nf4(ours) != theirs).sum())
    check(f"{shape}: lora_core dequantisation of bitsandbytes' state, elements differing from dequantize_4bit",
          differing, "==", 0, source="bitwise: the same codes, the same absmax arithmetic (lora_core/bnb_format.py)")
    own = quantize_nf4(w)
    out = torch.empty_like(w)
    ms = interleaved_rounds({"bitsandbytes": lambda: F.dequantize_4bit(packed, state),
                             "lora_core (bitsandbytes state)": lambda: dequantize_nf4(ours, out=out),
                             "lora_core (own state)": lambda: dequantize_nf4(own, out=out)})
    for name in ("lora_core (bitsandbytes state)", "lora_core (own state)"):
        est = PairedEstimate.of([b / o for b, o in zip(ms["bitsandbytes"], ms[name])])
        run_report.add_row("benchmarks", "NF4 dequantisation: bitsandbytes ms / lora_core ms, in turns (7 rounds)",
                           ("shape", "lora_core with", "ratio (median)", "SE", "bitsandbytes ms", "lora_core ms"),
                           (shape, name, round(est.median, 3), round(est.se, 3),
                            round(sorted(ms["bitsandbytes"])[3], 4), round(sorted(ms[name])[3], 4)))


def _qlora_steps(out_f: int, in_f: int, tokens: int = 8192, r: int = 16):
    """({name: closure of one forward+backward}, PEFT's layer): lora_core cupy on NF4, PEFT on a bitsandbytes
    Linear4bit."""
    import peft
    w, packed, state = _bnb_weight(out_f, in_f)
    x = torch.randn(1, tokens, in_f, device="cuda", dtype=DT, requires_grad=True)
    dy = torch.randn(1, tokens, out_f, device="cuda", dtype=DT)
    linear = torch.nn.Linear(in_f, out_f, bias=False, device="cuda", dtype=DT).requires_grad_(False)
    with torch.no_grad():
        linear.weight.copy_(w)
    ours = lora_core.LoRALinear.from_linear(linear, r=r, alpha=2 * r, backend="cupy", adapter_dtype=DT, quantize="nf4")
    torch.nn.init.normal_(ours.lora_B, std=0.02)
    q4 = bnb.nn.Linear4bit(in_f, out_f, bias=False, compute_dtype=DT, compress_statistics=True, quant_type="nf4",
                           device="meta")
    q4.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True, quant_type="nf4",
                                  blocksize=64).to("cuda")
    holder = torch.nn.Module()
    holder.q_proj = q4
    holder.is_loaded_in_4bit = True  # as transformers marks a 4-bit model: PEFT wraps with its bitsandbytes layer
    peft.inject_adapter_in_model(peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj"], lora_dropout=0.0),
                                 holder)
    layer = holder.q_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    with torch.no_grad():
        a.data, b.data = a.data.to(DT), torch.randn_like(b.data, dtype=DT) * 0.02
    steps = {"cupy-nf4": lambda: torch.autograd.grad(ours(x), (x, ours.lora_A, ours.lora_B), dy),
             "peft-bnb": lambda: torch.autograd.grad(layer(x), (x, a, b), dy)}
    return steps, layer


def _extra_peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


@pytest.mark.parametrize("shape", list(SHAPES))
def test_qlora_layer_vs_bitsandbytes(shape, run_report, check):
    from peft.tuners.lora.bnb import Linear4bit as PeftLinear4bit
    steps, layer = _qlora_steps(*SHAPES[shape])
    check(f"{shape}: the peft-bnb row runs PEFT's bitsandbytes layer", type(layer).__module__ + "." + type(layer).__name__,
          "==", f"{PeftLinear4bit.__module__}.{PeftLinear4bit.__name__}")
    ms = interleaved_rounds(steps)
    est = PairedEstimate.of([p / c for p, c in zip(ms["peft-bnb"], ms["cupy-nf4"])])
    peaks = {name: _extra_peak_mib(fn) for name, fn in steps.items()}
    run_report.add_row("benchmarks", "QLoRA layer forward+backward, 8192 tokens r16: peft-bnb ms / cupy-nf4 ms, "
                       "in turns (7 rounds); extra peak over the inputs",
                       ("shape", "ratio (median)", "SE", "cupy-nf4 ms", "peft-bnb ms", "cupy-nf4 extra peak MiB",
                        "peft-bnb extra peak MiB"),
                       (shape, round(est.median, 3), round(est.se, 3), round(sorted(ms["cupy-nf4"])[3], 3),
                        round(sorted(ms["peft-bnb"])[3], 3), round(peaks["cupy-nf4"], 1), round(peaks["peft-bnb"], 1)))
