"""Whole-model gradient checks: every adapter's gradient against an fp32 copy of the same model.

A layer-level parity test cannot see bugs that live between layers (a saved activation shared by two
layers, a gradient-accumulation step that forgets to weight its micro-batches, a recompute under
activation checkpointing that differs from the first pass). These checks run the whole model.

For adapter parameter p, with g_X(p) its gradient from run X on one batch:

    err_X(p) = ‖g_X(p) − g_ref(p)‖_F / ‖g_ref(p)‖_F

where ``ref`` is the same model upcast to fp32 (exact: bf16 ⊂ fp32) on the torch reference backend,
the whole batch in one pass (so it shares no code path with the accumulation or checkpointing under
test), and ``base`` is the 16-bit model on the torch reference backend, whole batch: its error is what
16-bit rounding alone costs. A candidate passes for p when

    err_cand(p) ≤ factor · max(err_base(p), median_q err_base(q))

The median term keeps one adapter whose reference error happens to be tiny from demanding more of the
candidate than rounding allows elsewhere. The bugs these checks exist for give err = O(1): a missing
1/k weighting gives err = k − 1; a stale activation gives the gradient of another layer's input.
Adam's first update is invariant to the gradient's scale (Δ = −lr·g/(|g|+ε)), so comparing updates would
miss a scale bug: the gradients themselves are compared, and the accumulated loss against the full batch's.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from lora_core.inject import adapter_parameters, lora_modules
from lora_core.loss_head import unfuse_loss
from lora_suite.engine import trainer

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class GradientRun:
    loss: float
    grads: dict[str, torch.Tensor]  # adapter name -> fp32 gradient


@dataclass(frozen=True)
class GradientAgreement:
    name: str  # adapter parameter
    err: float  # err_cand
    err_base: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.err <= self.tol  # NaN never passes


def split_batch(batch: dict[str, torch.Tensor], k: int) -> list[dict[str, torch.Tensor]]:
    """k micro-batches of equal size along the batch dimension."""
    n = batch["input_ids"].shape[0]
    if k < 1 or n % k:
        raise ValueError(f"cannot split a batch of {n} into k={k} equal micro-batches")
    return [{key: v[i * (n // k) : (i + 1) * (n // k)] for key, v in batch.items()} for i in range(k)]


def adapter_gradients(
    model: nn.Module, micro_batches: list[dict[str, torch.Tensor]], adapters: dict[str, nn.Parameter] | None = None
) -> GradientRun:
    """Gradients of every adapter after the trainer's own accumulation over ``micro_batches``."""
    adapters = adapter_parameters(model) if adapters is None else adapters
    for p in adapters.values():
        p.grad = None
    model.train()
    loss = trainer.accumulate_gradients(model, micro_batches)
    missing = [n for n, p in adapters.items() if p.grad is None]
    if missing:
        raise AssertionError(f"adapters without a gradient: {missing[:5]} ({len(missing)} of {len(adapters)})")
    # every adapter has a gradient (checked above): the filter only tells mypy so
    grads = {n: p.grad.detach().float().clone() for n, p in adapters.items() if p.grad is not None}
    for p in adapters.values():
        p.grad = None
    return GradientRun(float(loss), grads)


def reference_model(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A deep copy in ``dtype`` (fp32 for a 16-bit model, fp64 for an fp32 one) on the torch reference backend, with
    the model's own loss (a fused one, ``lora_core.loss_head``, taken off).

    Upcasting is exact (bf16 ⊂ fp16-range fp32 ⊂ fp64), so the copy computes the same function in more precision.
    """
    ref = copy.deepcopy(model).to(dtype)
    for m in lora_modules(ref).values():
        m.backend = "torch"
    unfuse_loss(ref)  # the reference's loss is transformers' own, over materialised logits
    return ref


@torch.no_grad()
def randomize_lora_b(
    model: nn.Module, std: float = 0.02, seed: int = 0, adapters: dict[str, nn.Parameter] | None = None
) -> None:
    """Non-zero B (it starts at 0): with B = 0, dA = s·(dY B)ᵀ x is exactly 0 and nothing about dA is tested."""
    gen = torch.Generator().manual_seed(seed)
    adapters = adapter_parameters(model) if adapters is None else adapters
    for name, p in adapters.items():
        if name.endswith(".lora_B"):
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def relative_errors(cand: GradientRun, ref: GradientRun) -> dict[str, float]:
    if set(cand.grads) != set(ref.grads):
        raise ValueError(f"runs differ in adapters: {sorted(set(cand.grads) ^ set(ref.grads))[:5]}")
    out = {}
    for name, g in cand.grads.items():
        r = ref.grads[name].to(g.device)
        norm = float(r.norm())
        diff = float((g - r).norm())
        out[name] = diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))
    return out


def agreement(cand_err: dict[str, float], base_err: dict[str, float], factor: float) -> list[GradientAgreement]:
    """Per-adapter verdicts (module docstring): err_cand ≤ factor·max(err_base, median err_base)."""
    floor = statistics.median(base_err.values())
    return [GradientAgreement(n, e, base_err[n], factor * max(base_err[n], floor)) for n, e in cand_err.items()]


def describe_failures(rows: list[GradientAgreement], limit: int = 5) -> str:
    bad = sorted((r for r in rows if not r.ok), key=lambda r: -r.err if r.err == r.err else float("-inf"))
    text = "; ".join(
        f"{r.name}: err {r.err:.3e} > tol {r.tol:.3e} (16-bit reference err {r.err_base:.3e})" for r in bad[:limit]
    )
    return f"{len(bad)} of {len(rows)} adapters beyond tolerance: {text}" if bad else ""


@dataclass(frozen=True)
class WholeModelResult:
    label: str  # which run: the backend, accumulation, checkpointing
    rows: list[GradientAgreement]
    loss: float
    loss_ref: float
    loss_base: float

    @property
    def n_bad(self) -> int:
        return sum(not r.ok for r in self.rows)

    @property
    def loss_gap(self) -> float:
        return abs(self.loss - self.loss_ref) / abs(self.loss_ref)

    def loss_tol(self, factor: float, floor: float) -> float:
        """factor·max(|loss_base − loss_ref| / loss_ref, floor): the loss analogue of the gradient band."""
        return factor * max(abs(self.loss_base - self.loss_ref) / abs(self.loss_ref), floor)


def copy_adapters(dst: dict[str, nn.Parameter], src: dict[str, torch.Tensor]) -> None:
    """Copy adapter values by canonical name (``<module path>.lora_A`` / ``.lora_B``); the sets must be equal."""
    if set(dst) != set(src):
        raise ValueError(f"adapter names differ: {sorted(set(dst) ^ set(src))[:5]}")
    with torch.no_grad():
        for name, p in dst.items():
            p.copy_(src[name].to(device=p.device, dtype=p.dtype))


def perturb_lora_a(adapters: dict[str, nn.Parameter], relative: float, seed: int = 99) -> None:
    """The control run's start: every lora_A multiplied elementwise by 1 ± ``relative`` (random signs, seeded), a
    rounding-level change (bf16 unit roundoff) whose effect on the loss curve sets the tiers' tolerance band."""
    with torch.no_grad():
        for name, p in adapters.items():
            if name.endswith("lora_A"):
                gen = torch.Generator(device=p.device).manual_seed(seed)
                sign = torch.randint(0, 2, p.shape, generator=gen, device=p.device) * 2 - 1
                p.mul_(1 + relative * sign)


def whole_model_checks(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    label: str,
    reference: nn.Module,
    adapters: dict[str, nn.Parameter] | None = None,
    reference_adapters=None,
    k: int | None,
    factor: float,
    reference_dtype: torch.dtype = torch.float32,
) -> list[WholeModelResult]:
    """Step-0 gradients of ``model`` (the implementation under test, named ``label``) vs an fp32 reference.

    ``reference`` is the same 16-bit model (same base weights, same adapter values) on the torch reference
    backend: its ``reference_dtype`` copy gives the reference gradients and its own 16-bit run the
    tolerance. Runs of the candidate, each on the same batch and adapters: the whole batch; the trainer's
    accumulation over k equal micro-batches (if k); the whole batch with activation checkpointing.
    """
    ref_model = reference_model(reference, reference_dtype)
    ref = adapter_gradients(ref_model, [batch])
    del ref_model
    base = adapter_gradients(reference, [batch], reference_adapters)
    base_err = relative_errors(base, ref)
    runs = [(f"{label}, whole batch", [batch], False)]
    if k:
        runs.append((f"{label}, accumulation over {k} micro-batches", split_batch(batch, k), False))
    runs.append((f"{label}, activation checkpointing", [batch], True))
    results = []
    hf = cast("PreTrainedModel", model)  # the whole-model checks run on transformers models (their checkpointing)
    for run_label, micro, checkpointing in runs:
        if checkpointing:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            cand = adapter_gradients(model, micro, adapters)
        finally:
            if checkpointing:
                hf.gradient_checkpointing_disable()
        rows = agreement(relative_errors(cand, ref), base_err, factor)
        results.append(WholeModelResult(run_label, rows, cand.loss, ref.loss, base.loss))
    return results
