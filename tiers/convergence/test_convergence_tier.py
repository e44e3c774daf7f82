"""convergence tier: the backend under test trains SmolLM2-135M (architecture) and follows the reference.

Four runs from the same base weights, the same initial adapters and the same batches:
  ours      the backend under test (cupy by default)
  reference the torch reference backend
  control   the torch reference backend with lora_A perturbed elementwise by a relative ±control_perturbation
            (bf16 unit roundoff): how far rounding-level noise alone moves the loss curve
  peft      PEFT's LoRA (when peft imports), started from the same adapter weights

Tolerance at step t (relative loss gap to the reference): max(factor·e(t), floor), where e(t) is the
running max of the control's relative gap up to t. A correct implementation differs from the reference by
rounding, so its gap stays within a small multiple of what rounding noise produces; a wrong gradient
(missing scale, wrong transpose, stale activations) changes the trajectory at the scale of the learning
signal itself, orders of magnitude above (tests/test_convergence_criterion.py shows such a bug caught on
the CPU). The floor covers the first steps, where the control's gap is still exactly 0 (B = 0).
The arithmetic is ``lora_suite.criteria.loss_match``.
"""

from __future__ import annotations

import gc

import pytest
import torch

from lora_suite.criteria import loss_drop, loss_match
from lora_core.inject import adapter_parameters
from lora_suite.models import build_model
from lora_suite.recipe import DTYPES
from lora_suite.report import Series
from lora_suite.trainer import train

pytestmark = [pytest.mark.gpu, pytest.mark.convergence]


def _run(tier, cfg, backend, init, perturb=0.0):
    prepared = tier.prepare(cfg, backend=backend)
    adapters = adapter_parameters(prepared.model)
    with torch.no_grad():
        for name, p in adapters.items():
            p.copy_(init[name])
            if perturb and name.endswith("lora_A"):
                gen = torch.Generator(device=p.device).manual_seed(99)
                sign = torch.randint(0, 2, p.shape, generator=gen, device=p.device) * 2 - 1
                p.mul_(1 + perturb * sign)
    result = train(prepared.model, prepared.batches, cfg.train)
    if backend == cfg.backend:
        tier.check_backend(prepared.model, backend)
    del prepared
    gc.collect()
    torch.cuda.empty_cache()
    return result


def _run_peft(tier, cfg, init):
    peft = pytest.importorskip("peft")
    built = build_model(cfg.model, cfg.weights, DTYPES[cfg.dtype], "cuda", seed=cfg.train.seed)
    targets = "all-linear" if cfg.lora.targets == ("all-linear",) else list(cfg.lora.targets)  # PEFT's spelling
    model = peft.get_peft_model(built.model, peft.LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                                             target_modules=targets, lora_dropout=0.0))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, p in trainable.items():  # base_model.model.<path>.lora_A.default.weight -> <path>.lora_A
            ours = name.removeprefix("base_model.model.").replace(".default.weight", "")
            p.copy_(init[ours].to(p.dtype))
    assert len(trainable) == len(init), f"PEFT made {len(trainable)} adapter tensors, ours {len(init)}"
    batches = tier.batches_for(cfg, built)
    result = train(model, batches, cfg.train, adapters=trainable)
    del model, built
    gc.collect()
    torch.cuda.empty_cache()
    return result


def test_convergence_and_match_to_reference(tier):
    cfg = tier.config("convergence")
    crit = cfg.criteria
    # The initial adapters every run starts from: those of the first injection (seeded).
    first = tier.prepare(cfg)
    init = {n: p.detach().clone() for n, p in adapter_parameters(first.model).items()}
    del first
    ours = _run(tier, cfg, cfg.backend, init)
    ref = _run(tier, cfg, "torch", init)
    control = _run(tier, cfg, "torch", init, perturb=crit.control_perturbation)
    try:
        peft_run = _run_peft(tier, cfg, init)
    except pytest.skip.Exception:
        peft_run = None
        tier.report.notes.append("peft does not import: no PEFT comparison in this run")

    rows, beyond = loss_match(ours.losses, ref.losses, control.losses, crit.loss_match_factor, crit.loss_match_floor)
    beyond_peft = []
    if peft_run is not None:
        peft_rows, beyond_peft = loss_match(peft_run.losses, ref.losses, control.losses, crit.loss_match_factor,
                                            crit.loss_match_floor)
        rows = [row + (prow[2], prow[3]) for row, prow in zip(rows, peft_rows)]
    cols = ("step", "reference (torch)", f"ours ({cfg.backend})", "rel diff", "control envelope e(t)", "tolerance")
    if peft_run is not None:
        cols += ("peft", "peft rel diff")
    tier.report.add_series(Series(tier.nodeid, "per-step loss: reference vs ours (and PEFT)", cols, tuple(rows),
                                  plot_x="step", plot_y=cols[1:3] + (("peft",) if peft_run is not None else ())))
    tier.record_steps(f"convergence ({cfg.backend})", ours.records)
    drop = loss_drop(ours.losses, crit.loss_window)
    source = "max(loss_match_factor*e(t), loss_match_floor): configs/convergence.yaml"
    verdicts = [
        tier.check.soft(f"loss drop, mean of first {crit.loss_window} vs last {crit.loss_window} steps",
                        round(drop, 4), ">=", crit.loss_drop_min, source="configs/convergence.yaml loss_drop_min"),
        tier.check.soft(f"steps where {cfg.backend} leaves the tolerance band (first: {beyond[:5]})", len(beyond),
                        "==", 0, source=source),
    ]
    if peft_run is not None:
        verdicts.append(tier.check.soft(f"steps where PEFT leaves the tolerance band (first: {beyond_peft[:5]})",
                                        len(beyond_peft), "==", 0, source=source))
    tier.assert_all(verdicts)
