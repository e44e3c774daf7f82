"""The fused-stack table (issue 27): each LoRA stack's forward, backward and whole-step device time and its peak
memory, on random-initialised Llama-family architectures, all-linear r16, bf16 base, fp32 adapters, AdamW.

Stacks (row -> implementation, whether Liger-Kernel's non-LoRA ops are applied on top):

    peft              PEFT's LoRA layers
    peft+axolotl      PEFT's layers driven by Axolotl's LoRA MLP / QKV / O kernels (implementation ``axolotl``)
    peft-liger        PEFT with Liger's RMSNorm, RoPE, SwiGLU, fused linear cross-entropy
    cupy              lora_core, one LoRA linear per projection
    cupy+liger        cupy with Liger's ops
    cupy-fused        lora_core's fused MLP and QKV
    cupy-fused+liger  cupy-fused with Liger's RMSNorm, RoPE and fused linear cross-entropy (its SwiGLU is its own)
    unsloth           Unsloth as its users run it: its loader, get_peft_model, fused LoRA kernels, patched Llama
                      forward and fused cross-entropy (implementation ``unsloth``); each of its runs, timed or
                      profiled, in a child process of its own (``lora_suite.scenarios.fused_child``)

Eager runs (GPU-bound batches) time each step with four CUDA events: forward (through the loss), backward,
optimizer step; the figures are medians over the measured steps. Captured runs (the tiers' batches, where an
eager step is host-bound) go through the project's trainer with ``train.cuda_graph`` and report the whole step.
Peak: the run's own ``torch.cuda.max_memory_allocated`` from before its model is built (``PeakWindow``: what earlier
runs left allocated is excluded), weights included (the same base for every stack).
Rounds in turns (``schedule``): each round of a case runs every stack once, each round's order a rotation of the
stacks by an evenly spaced offset (no stack always goes first, and each stack's places spread over the order), so
that a drift of the host or the GPU across a case does not favour the stacks that ran first. Eager cases run
``eager_rounds()`` rounds (``EAGER_ROUNDS`` = 3, or ``$LORA_SUITE_FUSED_ROUNDS``); captured runs ``ROUNDS`` = 2.
Each stack's figure is the median of its rounds, read beside its spread (the least and the greatest round); a
comparison says whether its ratio is beyond that spread (the summary's cells: ``lora_suite.scenarios.fused_cells``;
``lora_suite.measure.round_spread`` gives the rule).
Kernel profiles (``lora_suite.scenarios.step_profile``): eager steps under ``torch.profiler``, kernel time per step
by kind, the top kernels and launching host ops, beside the eager step's span (the host-bound gap is the span less
the kernel time); lora_core's stacks in this process, Unsloth in a child (``fused_child.profile_in_child``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import statistics
from collections.abc import Mapping

import torch

from lora_suite.scenarios.training_bench import Case, run_config

STACKS: dict[str, tuple[str, bool]] = {
    "peft": ("peft", False),
    "peft+axolotl": ("axolotl", False),
    "peft-liger": ("peft-liger", False),
    "cupy": ("cupy", False),
    "cupy+liger": ("cupy", True),
    "cupy-fused": ("cupy-fused", False),
    "cupy-fused+liger": ("cupy-fused", True),
    "unsloth": ("unsloth", False),
}
# Stacks that patch transformers' Llama classes for their whole process (Unsloth, at its import): each of their runs
# is measured or profiled in a child process of its own (``lora_suite.scenarios.fused_child``), so that no other row
# runs their model code.
ISOLATED = frozenset({"unsloth"})
EAGER_CASES = (
    Case("smollm2-all-r16-32x1024", "smollm2-135m", ("all-linear",), 16, 32, 1024),
    Case("tinyllama-all-r16-16x1024", "tinyllama-1.1b", ("all-linear",), 16, 16, 1024),
    Case("llama3.1-8b-all-r16-2x1024", "llama-3.1-8b", ("all-linear",), 16, 2, 1024),
    Case("llama2-7b-all-r16-2x1024", "llama-2-7b", ("all-linear",), 16, 2, 1024),
    # issue 57: a Qwen2-shaped case (q/k/v biases) and a Gemma-shaped one (GeGLU, soft-capping, a 256k vocabulary)
    Case("qwen2.5-0.5b-all-r16-16x1024", "qwen2.5-0.5b", ("all-linear",), 16, 16, 1024),
    Case("gemma2-2b-all-r16-4x1024", "gemma-2-2b", ("all-linear",), 16, 4, 1024),
)
CAPTURED_CASES = (
    Case("smollm2-all-r16-8x512", "smollm2-135m", ("all-linear",), 16, 8, 512),
    Case("tinyllama-all-r16-4x512", "tinyllama-1.1b", ("all-linear",), 16, 4, 512),
)
# The full tier's step (configs/full.yaml): Llama-2-7B, NF4 base, q/k/v/o r8, 1x512, checkpointing, captured.
FULL_TIER_CASE = Case(
    "llama2-7b-qlora-qkvo-r8-1x512-ckpt",
    "llama-2-7b",
    ("q_proj", "k_proj", "v_proj", "o_proj"),
    8,
    1,
    512,
    gradient_checkpointing=True,
)
ROUNDS = 2  # the captured runs and the full tier's reuse variants (unchanged by issue 47)
EAGER_ROUNDS = 3  # eager runs: a step of these sizes swings by a third between runs (issue 47)
ROUNDS_ENV = "LORA_SUITE_FUSED_ROUNDS"


def eager_rounds(environ: Mapping[str, str] = os.environ) -> int:
    """The eager cases' rounds: ``$LORA_SUITE_FUSED_ROUNDS`` when set (an integer >= 1), else ``EAGER_ROUNDS``."""
    raw = environ.get(ROUNDS_ENV, "").strip()
    if not raw:
        return EAGER_ROUNDS
    try:
        rounds = int(raw)
    except ValueError:
        rounds = 0
    if rounds < 1:
        raise ValueError(f"{ROUNDS_ENV} must be an integer >= 1 (rounds of the fused table's eager cases), got {raw!r}")
    return rounds


def schedule(cases, stacks, rounds: int = ROUNDS) -> list[tuple[Case, int, str]]:
    """(case, round, stack) in run order: per case, every stack once a round, round r after round r - 1; round r's
    order is the stacks rotated by r * len(stacks) // rounds (evenly spaced starts: with rounds <= stacks no two
    rounds start with the same stack)."""
    names = list(stacks)
    if rounds < 1 or not names:
        raise ValueError(f"a schedule needs rounds >= 1 and a stack, got rounds={rounds}, stacks={names}")
    out = []
    for c in cases:
        for r in range(rounds):
            k = r * len(names) // rounds
            out += [(c, r, s) for s in names[k:] + names[:k]]
    return out


@dataclasses.dataclass(frozen=True)
class EagerFigures:
    fwd_ms: float
    bwd_ms: float
    step_ms: float  # forward + backward + optimizer step
    peak_gib: float
    served_by: str
    fused_ops: str
    # one more step after the timed ones (untimed): its loss and the adapters' gradient norm, which must be finite for
    # the figures to be of a step that computes something (NaN: not measured)
    loss: float = math.nan
    grad_norm: float = math.nan


def stack_config(case: Case, stack: str, mode: str, *, warmup: int, measured: int, quantize: str | None = None):
    impl, _ = STACKS[stack]
    cfg = run_config(case, impl, mode, warmup=warmup, measured=measured)
    if quantize:
        cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, quantize=quantize))
    return cfg


@contextlib.contextmanager
def stack_model(cfg, stack: str):
    """The prepared model of ``stack`` (Liger's ops applied when the stack says so); transformers' module-level
    names that Liger patches are put back afterwards, and the model's memory is released."""
    from lora_suite.engine.prepare import prepare
    from lora_suite.implementations.liger_ops import apply_liger_ops, restored_names
    from lora_suite.measure.memory import PeakWindow

    impl, with_liger = STACKS[stack]
    prepared = None
    # This run's own peak: earlier stacks' models are collected first (Liger's and Axolotl's patches, lora_core's
    # QKV groups make reference cycles, which only the cycle collector frees), what is still allocated is excluded.
    window = PeakWindow.open()
    try:
        with restored_names():  # peft-liger and the +liger stacks patch them
            prepared = prepare(cfg, "cuda", implementation=impl)
            if with_liger:  # captured runs: without the fused linear cross-entropy (liger_ops.LCE_LEFT_OUT)
                apply_liger_ops(prepared.model, captured=cfg.train.cuda_graph)
            yield prepared, window
    finally:
        del prepared
        gc.collect()
        torch.cuda.empty_cache()


def unavailable(stack: str, case: Case | None = None) -> str | None:
    """Why ``stack`` cannot run here (its implementation or Liger-Kernel missing) or on ``case``'s model (Liger's
    ops are applied to the families ``liger_ops.LIGER_FAMILIES``), or None."""
    import importlib.util

    from lora_suite.implementations import ImplementationError, resolve_implementation

    impl, liger = STACKS[stack]
    try:
        resolve_implementation(impl)
    except ImplementationError as exc:
        return str(exc)
    liger = liger or impl == "peft-liger"
    if liger and importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel not installed (install lora-gpu-suite[liger])"
    from lora_suite.implementations.liger_ops import LIGER_FAMILIES

    family = "llama" if case is None else model_family(case)
    if liger and case is not None and family not in LIGER_FAMILIES:  # no case: Llama's, one of them
        return f"Liger's ops are applied to the families {LIGER_FAMILIES} (liger_ops); {case.model} is {family}"
    return None


def model_family(case: Case) -> str:
    """The decoder family of ``case``'s model (configs/models/<model>.yaml: llama, qwen2, gemma2)."""
    from lora_suite.settings.loader import load_model_config

    return load_model_config(case.model).architecture.family


def captured_run(case: Case, stack: str, cfg):
    """(figures, steps replayed, served_by) of one run of ``stack`` on ``case`` through the project's trainer with
    ``cfg`` (captured when ``cfg.train.cuda_graph``): ``training_bench.figures`` after 5 warm-up steps."""
    from lora_suite.engine.trainer import train
    from lora_suite.scenarios import training_bench as TB

    with stack_model(cfg, stack) as (prepared, window):
        records = train(prepared.model, prepared.batches, cfg.train, adapters=prepared.adapters).records
        fig = TB.figures(records, case.batch_size * case.seq_len, 5, window.peak())
        return fig, sum(r.captured for r in records), prepared.implementation.served_by(prepared.model)


def eager_run(prepared, window, cfg, *, warmup: int, measured: int) -> EagerFigures:
    """Forward, backward and optimizer step timed apart with CUDA events; medians over the measured steps."""
    from lora_suite.implementations.liger_ops import describe_liger

    model = prepared.model
    model.train()
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = list(prepared.adapters.values())
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, fused=True)
    batch = prepared.batches(0)
    torch.cuda.synchronize()
    times = []
    for _ in range(warmup + measured):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        ev[1].record()
        loss.backward()
        ev[2].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ev[3].record()
        times.append(ev)
    torch.cuda.synchronize()
    spans = [(a.elapsed_time(b), b.elapsed_time(c), a.elapsed_time(d)) for a, b, c, d in times[warmup:]]
    fwd, bwd, step = (statistics.median(s[i] for s in spans) for i in range(3))
    peak = torch.cuda.max_memory_allocated() / 2**30
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss  # the untimed step (EagerFigures)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in params if p.grad is not None]))
    opt.zero_grad(set_to_none=True)
    served = prepared.implementation.served_by(model)
    return EagerFigures(fwd, bwd, step, peak, served, describe_liger(model), float(loss), float(norm))
