"""convergence tier: the implementation under test trains SmolLM2-135M (architecture) and follows the reference.

Four runs from the same base weights, the same initial adapters and the same batches:
  ours      the implementation under test (--lora-impl, cupy by default)
  reference the torch reference backend
  control   the torch reference backend with lora_A perturbed elementwise by a relative ±control_perturbation
            (bf16 unit roundoff): how far rounding-level noise alone moves the loss curve; ``criteria.control_runs``
            of them, each with its own random signs, and e(t) below the running max over all
  peft      PEFT's LoRA (when peft imports and is not itself under test), from the same adapter weights

Tolerance at step t (relative loss gap to the reference): max(factor·e(t), floor), where e(t) is the
running max of the control's relative gap up to t. A correct implementation differs from the reference by
rounding, so its gap stays within a small multiple of what rounding noise produces; a wrong gradient
(missing scale, wrong transpose, stale activations) changes the trajectory at the scale of the learning
signal itself, orders of magnitude above (tests/test_convergence_criterion.py shows such a bug caught on
the CPU). The floor covers the first steps, where the control's gap is still exactly 0 (B = 0).
The arithmetic is ``lora_suite.measure.criteria.loss_match``.

Resumed vs uninterrupted (``criteria.resume_at_step``: K): the run under test writes a checkpoint after step K - 1
(its adapters through its own ``save_adapter``, AdamW's state, the step: ``lora_suite.engine.resume``); a fresh model
of the same config loads it through the implementation's ``load_adapter`` and trains on to the last step. A complete
resume computes what the uninterrupted run computes, so its losses must stay in the band that a resume right by
construction sets (the adapters copied by name, ``resume_by_name``: max(factor·e(t), floor) with e(t) its gap); a
resume that loses or misplaces optimizer state, adapters or the schedule moves them at the scale of the learning
signal (selftest-gpu's ``test_planted_resume_layers_in_text_order.py``).
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from lora_suite.engine.gradients import copy_adapters, perturb_lora_a
from lora_suite.engine.resume import resume, resume_by_name, train_with_checkpoint
from lora_suite.engine.trainer import train
from lora_suite.harness.figures import record_figure
from lora_suite.harness.report import Series
from lora_suite.implementations import ImplementationError, resolve_implementation
from lora_suite.measure.criteria import loss_drop, loss_match, widest_control
from lora_suite.settings.loader import load_model_config

pytestmark = [pytest.mark.gpu, pytest.mark.convergence]
QWEN2_SHAPE = "qwen2-smollm2-shape"  # the non-Llama model of issue 55 (lora_suite/configs/models/)
CONTROL_SEED = 99  # control run i perturbs with the signs of seed CONTROL_SEED + i
RESUME_CHECK = "steps where the resumed run leaves the band around the uninterrupted run"


def _run(
    tier, cfg, implementation, init, perturb=0.0, perturb_seed=CONTROL_SEED, checkpoint=None, kept=None, final=None
):
    """Train from the adapters ``init`` (canonical names: ``Prepared.canonical``) with ``implementation`` (a name or
    the one under test); ``checkpoint``: (step K, directory) where the run writes its checkpoint after step K - 1, its
    adapters' values at K then put in the dict ``kept``; ``final``: a dict given the adapters' values at the end."""
    prepared = tier.prepare(cfg, implementation=implementation)
    copy_adapters(prepared.canonical(), init)
    if perturb:
        perturb_lora_a(prepared.canonical(), perturb, seed=perturb_seed)
    if checkpoint is not None:
        result, at_checkpoint = train_with_checkpoint(prepared, cfg.train, *checkpoint)
        kept.update(at_checkpoint)
    else:
        result = train(prepared.model, prepared.batches, cfg.train, adapters=prepared.adapters)
    if prepared.implementation is tier.impl:
        tier.check_served(prepared)
    if final is not None:
        final.update({n: t.detach().cpu().clone() for n, t in prepared.canonical().items()})
    del prepared
    gc.collect()
    torch.cuda.empty_cache()
    return result


def control_losses(tier, cfg, init) -> list[list[float]]:
    """The losses of the ``criteria.control_runs`` control runs (torch reference, lora_A perturbed by
    ±control_perturbation, each with its own signs); ``widest_control`` reduces them for one comparison."""
    crit = cfg.criteria
    return [
        _run(tier, cfg, "torch", init, perturb=crit.control_perturbation, perturb_seed=CONTROL_SEED + i).losses
        for i in range(crit.control_runs)
    ]


def test_convergence_and_match_to_reference(tier, tmp_path):
    converge(tier, tier.config("convergence"), "", tmp_path)


def test_convergence_on_a_qwen2_shaped_model(tier, tmp_path):
    """The same runs on a Qwen2-shaped model at SmolLM2's widths (``configs/models/qwen2-smollm2-shape.yaml``: q, k
    and v with a bias), random-initialised: a stack that drops the base's bias, or trains it, leaves the band around
    the torch reference (lora_core's layer keeps it, frozen). Check and table names start with ``qwen2-shape: ``."""
    cfg = tier.config("convergence")
    converge(
        tier,
        dataclasses.replace(cfg, model=load_model_config(QWEN2_SHAPE), weights="random"),
        "qwen2-shape: ",
        tmp_path,
    )


class Prefixed:
    """``tier.check`` with ``label`` before every check's name (the same checks for a second model)."""

    def __init__(self, check, label: str):
        self.check, self.label = check, label

    def __call__(self, name, *args, **kwargs):
        return self.check(self.label + name, *args, **kwargs)

    def not_applicable(self, name, reason):
        return self.check.not_applicable(self.label + name, reason)


def converge(tier, cfg, label: str, tmp_path) -> tuple[dict, dict]:
    """The four runs (five with the eager twin of a captured run, six with the resumed one) and every check of the
    tier on ``cfg``'s model, check and table names prefixed with ``label``; returns the adapters the run under test
    started from and ended with (canonical names, on the CPU)."""
    check = Prefixed(tier.check, label)
    crit = cfg.criteria
    name = tier.impl.name
    # The initial adapters every run starts from: those of the first injection (seeded).
    first = tier.prepare(cfg)
    init = {n: p.detach().clone() for n, p in first.canonical().items()}
    del first
    resume_at = crit.resume_at_step
    kept: dict = {}
    checkpoint = None if resume_at is None else (resume_at, tmp_path / "resume")
    final: dict = {}
    ours = _run(tier, cfg, None, init, checkpoint=checkpoint, kept=kept, final=final)
    ref = _run(tier, cfg, "torch", init)
    controls = control_losses(tier, cfg, init)
    control = widest_control(controls, ref.losses)
    peft_run = None
    peft_check = "steps where PEFT leaves the tolerance band"
    if name == "peft":
        check.not_applicable(peft_check, "PEFT is the implementation under test: its own check above")
    else:
        try:
            peft_impl = resolve_implementation("peft")
        except ImplementationError as exc:  # peft does not import here
            check.not_applicable(peft_check, str(exc))
        else:
            no_nf4 = cfg.lora.quantize and peft_impl.reason_not_applicable("nf4_base")
            if no_nf4:  # peft-bnb under test is PEFT on this base; PEFT alone has no NF4 base to compare on
                check.not_applicable(peft_check, f"the base is {cfg.lora.quantize}: {no_nf4}")
            else:
                peft_run = _run(tier, cfg, peft_impl, init)

    captured_check = "steps where captured training leaves the band around eager training"
    ours_eager = None
    if cfg.train.cuda_graph:
        ours_eager = _run(
            tier, dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, cuda_graph=False)), None, init
        )
        replayed = sum(r.captured for r in ours.records)
        check(
            f"{name}: steps replayed from the captured graph",
            replayed,
            "==",
            cfg.train.steps - cfg.train.graph_warmup_steps,
            source="train.cuda_graph: the mode ran",
        )
    else:
        check.not_applicable(
            captured_check,
            "train.cuda_graph is off for this run (configs/convergence.yaml, the implementation's declaration, or a "
            "mixture-of-experts model, whose routing sizes each expert's work on the host)",
        )

    rows, beyond = loss_match(ours.losses, ref.losses, control, crit.loss_match_factor, crit.loss_match_floor)
    beyond_peft: list[int] = []
    if peft_run is not None:
        peft_rows, beyond_peft = loss_match(
            peft_run.losses, ref.losses, control, crit.loss_match_factor, crit.loss_match_floor
        )
        rows = [row + (prow[2], prow[3]) for row, prow in zip(rows, peft_rows)]
    cols: tuple[str, ...] = (
        "step",
        "reference (torch)",
        f"ours ({name})",
        "rel diff",
        "control envelope e(t)",
        "tolerance",
    )
    if peft_run is not None:
        cols += ("peft", "peft rel diff")
    tier.report.add_series(
        Series(
            tier.nodeid,
            f"{label}per-step loss: reference vs ours (and PEFT)",
            cols,
            tuple(rows),
            plot_x="step",
            plot_y=cols[1:3] + (("peft",) if peft_run is not None else ()),
        )
    )
    tier.record_steps(f"{label}convergence ({name})", ours.records)
    drop = loss_drop(ours.losses, crit.loss_window)
    if not label:  # the headline figure is the tier's own model's (configs/convergence.yaml suite.figures)
        record_figure(tier.report, tier.nodeid, "convergence", "loss drop", drop)
    source = "max(loss_match_factor*e(t), loss_match_floor): configs/convergence.yaml"
    check(
        f"loss drop, mean of first {crit.loss_window} vs last {crit.loss_window} steps",
        round(drop, 4),
        ">=",
        crit.loss_drop_min,
        source="configs/convergence.yaml loss_drop_min",
    )
    check(f"steps where {name} leaves the tolerance band (first: {beyond[:5]})", len(beyond), "==", 0, source=source)
    if peft_run is not None:
        check(f"{peft_check} (first: {beyond_peft[:5]})", len(beyond_peft), "==", 0, source=source)
    if ours_eager is not None:
        cap_rows, beyond_cap = loss_match(
            ours.losses,
            ours_eager.losses,
            widest_control(controls, ours_eager.losses),
            crit.loss_match_factor,
            crit.loss_match_floor,
        )
        tier.report.add_series(
            Series(
                tier.nodeid,
                f"{label}per-step loss: {name} captured vs {name} eager",
                ("step", "eager", "captured", "rel diff", "control envelope e(t)", "tolerance"),
                tuple(cap_rows),
                plot_x="step",
                plot_y=("eager", "captured"),
            )
        )
        identical = sum(a == b for a, b in zip(ours.losses, ours_eager.losses))
        tier.report.notes.append(
            f"{tier.nodeid}: captured and eager losses bitwise equal on {identical} of "
            f"{len(ours.losses)} steps; max relative gap {max(r[3] for r in cap_rows):.3g}"
        )
        check(f"{captured_check} (first: {beyond_cap[:5]})", len(beyond_cap), "==", 0, source=source)
    if resume_at is None:
        check.not_applicable(RESUME_CHECK, "criteria.resume_at_step is null in configs/convergence.yaml")
    else:
        resumed = resume_match(tier, cfg, None, ours.losses, kept, tmp_path / "resume", label)
        how = "max(loss_match_factor*e(t), loss_match_floor), e(t) of a resume by name: configs/convergence.yaml"
        check(f"{RESUME_CHECK} (first: {resumed[:5]})", len(resumed), "==", 0, source=how)
    return {n: t.cpu() for n, t in init.items()}, final


def _resumed(tier, cfg, implementation, how, *args):
    """(the checkpoint's step, the losses of the steps from it on, the implementation's name) of a resume in a fresh
    model (``how``: ``resume`` or ``resume_by_name``)."""
    prepared = tier.prepare(cfg, implementation=implementation)
    step, result = how(prepared, cfg.train, *args)
    name = prepared.implementation.name
    del prepared
    gc.collect()
    torch.cuda.empty_cache()
    return step, result.losses, name


def resume_match(tier, cfg, implementation, uninterrupted, kept, directory, label: str = "") -> list[int]:
    """Resume checkpoint ``directory`` (written by the run whose losses are ``uninterrupted``, its adapters' values
    ``kept``) in a fresh model of ``implementation`` (None: the one under test) through the implementation, and
    again by name (``lora_suite.engine.resume``: the control); the losses of the resumed steps against the
    uninterrupted run's in the band the by-name resume sets (``loss_match``). Adds the table and a note to the
    report; returns the steps beyond the band."""
    crit = cfg.criteria
    step, losses, name = _resumed(tier, cfg, implementation, resume, directory)
    _, by_name, _ = _resumed(tier, cfg, implementation, resume_by_name, directory, kept)
    head = list(uninterrupted[:step])
    rows, beyond = loss_match(
        head + losses, uninterrupted, head + by_name, crit.loss_match_factor, crit.loss_match_floor
    )
    tier.report.add_series(
        Series(
            tier.nodeid,
            f"{label}per-step loss: {name} uninterrupted vs resumed at step {step}",
            ("step", "uninterrupted", "resumed", "rel diff", "by-name resume envelope e(t)", "tolerance"),
            tuple(rows[step:]),
            plot_x="step",
            plot_y=("uninterrupted", "resumed"),
        )
    )
    identical = [sum(a == b for a, b in zip(run, uninterrupted[step:])) for run in (losses, by_name)]
    tier.report.notes.append(
        f"{tier.nodeid}: {label}{name} resumed at step {step}: losses bitwise equal to the uninterrupted run's on "
        f"{identical[0]} of {len(losses)} steps (the by-name resume: {identical[1]}); max relative gap "
        f"{max(r[3] for r in rows[step:]):.3g}"
    )
    return beyond
