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
- ``test_qlora_7b_training_step_vs_peft_bnb``: the full tier's 7B QLoRA training step, cupy against peft-bnb,
  eager and captured, taking turns; step ms, ratios to cupy eager and each one's peak.
Rows, not bars: the issue sets no target. Skipped where bitsandbytes does not import (GPU runners without network access
need its wheel carried: only the library matching torch's CUDA is needed).
"""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch

import lora_core
from lora_core.bnb_format import from_bnb
from lora_core.nf4 import dequantize_nf4, quantize_nf4
from lora_suite.engine.prepare import fit_to_implementation, prepare
from lora_suite.harness.cuda_errors import is_cuda_error
from lora_suite.implementations import resolve_implementation
from lora_suite.measure.memory import PeakWindow
from lora_suite.measure.timing import PairedEstimate, interleaved_rounds
from lora_suite.scenarios import training_bench as TB
from lora_suite.settings.config import CONFIG_DIR
from lora_suite.settings.loader import load_tier_config

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark]
bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: pip install lora-gpu-suite[peft-bnb]")

SHAPES = {
    "llama7b-4096to4096": (4096, 4096),
    "llama7b-4096to11008": (11008, 4096),
    "llama7b-11008to4096": (4096, 11008),
}  # (out, in) of the weight
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
    check(
        f"{shape}: lora_core dequantisation of bitsandbytes' state, elements differing from dequantize_4bit",
        differing,
        "==",
        0,
        source="bitwise: the same codes, the same absmax arithmetic (lora_core/bnb_format.py)",
    )
    own = quantize_nf4(w)
    out = torch.empty_like(w)
    ms = interleaved_rounds(
        {
            "bitsandbytes": lambda: F.dequantize_4bit(packed, state),
            "lora_core (bitsandbytes state)": lambda: dequantize_nf4(ours, out=out),
            "lora_core (own state)": lambda: dequantize_nf4(own, out=out),
        }
    )
    for name in ("lora_core (bitsandbytes state)", "lora_core (own state)"):
        est = PairedEstimate.of([b / o for b, o in zip(ms["bitsandbytes"], ms[name])])
        run_report.add_row(
            "benchmarks",
            "NF4 dequantisation: bitsandbytes ms / lora_core ms, in turns (7 rounds)",
            ("shape", "lora_core with", "ratio (median)", "SE", "bitsandbytes ms", "lora_core ms"),
            (
                shape,
                name,
                round(est.median, 3),
                round(est.se, 3),
                round(sorted(ms["bitsandbytes"])[3], 4),
                round(sorted(ms[name])[3], 4),
            ),
        )


class _FourBitModel(torch.nn.Module):
    """A model of one layer marked as transformers marks a 4-bit model: PEFT wraps it with its bitsandbytes layer."""

    is_loaded_in_4bit = True


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
    q4 = bnb.nn.Linear4bit(
        in_f, out_f, bias=False, compute_dtype=DT, compress_statistics=True, quant_type="nf4", device="meta"
    )
    q4.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True, quant_type="nf4", blocksize=64).to(
        "cuda"
    )
    holder = _FourBitModel()
    holder.q_proj = q4
    peft.inject_adapter_in_model(
        peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj"], lora_dropout=0.0), holder
    )
    layer = holder.get_submodule("q_proj")  # PEFT's layer now, in place of q4
    a, b = layer.get_parameter("lora_A.default.weight"), layer.get_parameter("lora_B.default.weight")
    with torch.no_grad():
        a.data, b.data = a.data.to(DT), torch.randn_like(b.data, dtype=DT) * 0.02
    steps = {
        "cupy-nf4": lambda: torch.autograd.grad(ours(x), (x, ours.lora_A, ours.lora_B), dy),
        "peft-bnb": lambda: torch.autograd.grad(layer(x), (x, a, b), dy),
    }
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
    check(
        f"{shape}: the peft-bnb row runs PEFT's bitsandbytes layer",
        type(layer).__module__ + "." + type(layer).__name__,
        "==",
        f"{PeftLinear4bit.__module__}.{PeftLinear4bit.__name__}",
    )
    ms = interleaved_rounds(steps)
    est = PairedEstimate.of([p / c for p, c in zip(ms["peft-bnb"], ms["cupy-nf4"])])
    peaks = {name: _extra_peak_mib(fn) for name, fn in steps.items()}
    run_report.add_row(
        "benchmarks",
        "QLoRA layer forward+backward, 8192 tokens r16: peft-bnb ms / cupy-nf4 ms, "
        "in turns (7 rounds); extra peak over the inputs",
        (
            "shape",
            "ratio (median)",
            "SE",
            "cupy-nf4 ms",
            "peft-bnb ms",
            "cupy-nf4 extra peak MiB",
            "peft-bnb extra peak MiB",
        ),
        (
            shape,
            round(est.median, 3),
            round(est.se, 3),
            round(sorted(ms["cupy-nf4"])[3], 3),
            round(sorted(ms["peft-bnb"])[3], 3),
            round(peaks["cupy-nf4"], 1),
            round(peaks["peft-bnb"], 1),
        ),
    )


STEP_ROUNDS = 5  # measured rounds of the 7B training-step comparison (one warm-up round first, left out)


def test_qlora_7b_training_step_vs_peft_bnb(benchmark, run_report, check):
    """The full tier's QLoRA training step (Llama-2-7B architecture, random weights, NF4 base, q/k/v/o r8, 1×512,
    activation checkpointing: configs/full.yaml), cupy against peft-bnb (PEFT on bitsandbytes Linear4bit, the
    same config fitted to what it declares): each model's own peak first (``PeakWindow`` around its build and
    one eager and one captured turn), then both models eager and captured taking turns (``TB.take_turns``, the
    interleaved bench's turns); rows: median step ms and ratios to cupy's, per round, with SE. peft-bnb's run
    that fails is its finding (a failed check and a row saying what stopped it), not a suite error."""
    pytest.importorskip("peft", reason="peft is not installed: peft-bnb is PEFT on bitsandbytes")
    base = load_tier_config(CONFIG_DIR / "full.yaml")
    base = dataclasses.replace(base, weights="random")
    turns = {"eager": 5, "captured": 8}
    runs, peaks, stopped = {}, {}, {}
    for impl in ("cupy", "peft-bnb"):
        implementation = resolve_implementation(impl)
        cfg, changes = fit_to_implementation(
            dataclasses.replace(base, implementation=impl), implementation, "configs/full.yaml"
        )
        for what, reason in changes:
            check.not_applicable(f"7B QLoRA step {impl}: {what}", reason)
        modes = ["eager"] + (["captured"] if cfg.train.cuda_graph else [])
        window = PeakWindow.open()
        try:
            prepared = prepare(cfg, "cuda", implementation=implementation)
            check(f"7B QLoRA step {impl}: base stored as NF4", prepared.quantize, "==", "nf4")
            for mode in modes:
                tc = dataclasses.replace(cfg.train, steps=10**6, cuda_graph=mode == "captured", log_every=10**6)
                runs[f"{impl}-{mode}"] = TB.TurnRun(prepared, tc, mode)
            for mode in modes:  # one turn each inside the window: the peak of the run as the tier trains
                runs[f"{impl}-{mode}"].turn(turns[mode])
            torch.cuda.synchronize()
            peaks[impl] = window.peak() / 2**30
            check(
                f"7B QLoRA step {impl}: code path that served every LoRA layer",
                implementation.served_by(prepared.model),
                "==",
                implementation.expected_path,
            )
        except Exception as exc:
            if impl == "cupy" or is_cuda_error(exc):
                raise
            stopped[impl] = f"build or first turns: {type(exc).__name__}: {str(exc)[:300]}"
            for mode in modes:
                runs.pop(f"{impl}-{mode}", None)

    def turn(name, rnd):
        return runs[name].turn(turns[runs[name].mode])

    turned: list[tuple[dict[str, list[float]], dict[str, str]]] = []  # take_turns' answer: (times, stopped)

    def run_rounds():
        turned.append(
            TB.take_turns(
                list(runs), STEP_ROUNDS, turn, lambda name, exc: name.startswith("peft-bnb") and not is_cuda_error(exc)
            )
        )

    benchmark.group = "qlora-7b-training-step"
    benchmark.pedantic(run_rounds, rounds=1, iterations=1)
    times, turn_stopped = turned[0]
    stopped.update(turn_stopped)
    vs = TB.interleaved_speed(times, "cupy-eager")
    table = (
        f"7B QLoRA training step (configs/full.yaml, random weights): runs taking turns ({STEP_ROUNDS} rounds "
        "after a warm-up round), peak per implementation (its own window)"
    )
    for name, t in times.items():
        est = vs.get(name)
        impl = name.rsplit("-", 1)[0]
        run_report.add_row(
            "benchmarks",
            table,
            ("run", "median step ms (host)", "cupy eager ms / this ms", "SE", "peak GiB (eager and captured turns)"),
            (
                name,
                round(statistics.median(t) * 1e3, 2),
                1.0 if est is None else round(est.median, 3),
                None if est is None else round(est.se, 3),
                round(peaks.get(impl, float("nan")), 3),
            ),
        )
        benchmark.extra_info[f"{name}_step_ms"] = statistics.median(t) * 1e3
    benchmark.extra_info.update({f"{k}_peak_gib": v for k, v in peaks.items()})
    for name, why in stopped.items():
        run_report.add_row(
            "benchmarks",
            "7B QLoRA training step: runs that stopped (findings)",
            ("run", "what stopped it"),
            (name, why),
        )
        check(f"7B QLoRA step {name}: every turn ran", why, "==", None, source="a peer's failure is its finding")
