"""Adapters on a mixture-of-experts model's 3-D expert parameters (PEFT's ``target_parameters``), for any
implementation that adapts them (``LoRAImplementation.expert_adapters``); the function and gradients of the whole
adapted MoE model are ``model_function``'s (its reference puts W'ₑ = Wₑ + s·Bₑ·Aₑ in every expert's place). Here,
on the same case (``model_function.build_case``):

- **routing**: one token through the model, so that each MoE layer sends it to exactly k of its E experts (top-k):
  the factors of an expert the float64 reference routes to get a non-zero gradient, and those of an expert it does
  not route to get exactly zero (not merely a small one: a stack that moves every expert's adapter, through a dense
  delta's stray term or a gradient written to all experts, trains experts no token chose);
- **merge**: ``merge_adapters`` folds every expert's s·Bₑ·Aₑ into its own slice, in the parameter's stored layout
  (a square slice folded transposed is as wrong as a non-square one, though only the latter fails on shape): the
  logits are the float64 adapted model's; after ``unmerge_adapters`` (where offered) again;
- **round trip**: ``save_adapter``, then a model built the same way with other adapter values loads the folder: its
  expert factors bitwise the saved ones and its logits the float64 adapted model's.

Tolerance: ``model_function.model_tolerance`` (fp32 error model of the architecture).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

import torch

from lora_suite.engine.architectures import Architecture
from lora_suite.judges import model_function as MF
from lora_suite.judges.layer_checks import none_of
from lora_suite.judges.parity import compare
from lora_suite.measure.criteria import Verdict

SOURCE = "W'ₑ = Wₑ + s·Bₑ·Aₑ per expert (PEFT target_parameters, ParamWrapper); expert_adapters.py"
ROUTED_SOURCE = "an expert's adapter trains only on the tokens routed to it (top-k routing); expert_adapters.py"


def routing_verdict(case: MF.ArchCase) -> Verdict:
    """One token: each expert's A and B gradients zero exactly where the float64 reference's are (not routed)."""
    one = dataclasses.replace(case, ids=case.ids[:1, :1], dlogits=case.dlogits[:1, :1])
    got, want = MF.run_model(one), MF.reference_run(one)
    bad, judged = [], 0
    for name in one.experts:
        for end in ("lora_A", "lora_B"):
            key, ref = f"{name}.{end}", want.grads[f"{name}.{end}"]
            assert ref is not None, f"{key}: float64 gives every expert adapter a gradient tensor"
            g = got.grads.get(key)
            for e in range(ref.shape[0]):
                judged += 1
                routed = bool(ref[e].abs().max() > 0)
                moved = g is not None and bool(g[e].abs().max() > 0)
                if routed != moved:
                    what = "no gradient though routed to" if routed else "a gradient though not routed to"
                    bad.append(f"{key} expert {e}: {what}")
    return none_of(
        f"{case.arch.name}: expert adapters with a gradient where no token was routed, or none where one was "
        f"(of {judged})",
        bad,
        ROUTED_SOURCE,
        shown=4,
    )


def merge_reason(case: MF.ArchCase) -> str | None:
    """Why the merge of the experts is not judged on ``case``: the stack merges nothing, or its base is 4-bit."""
    if case.built is not None:
        return (
            f"{case.impl.name}'s base is 4-bit: merging re-quantises W + s·B·A of every adapted linear, no longer "
            "the adapted function within a tolerance"
        )
    return case.impl.merge_reason()


def merge_verdicts(case: MF.ArchCase) -> list[Verdict]:
    """``merge_adapters`` (then ``unmerge_adapters`` where offered): the logits of the float64 adapted model."""
    name, impl, tol = case.arch.name, case.impl, MF.model_tolerance(case)
    if merge_reason(case) is not None:
        return []
    want = MF.reference_run(case, backward=False).logits
    impl.merge_adapters(case.model)
    with torch.no_grad():
        merged = compare("logits", case.model(case.ids).logits, want, tol)
    out = [
        none_of(
            f"{name}: merged experts, logits beyond tolerance of the float64 adapted model",
            [] if merged.ok else [merged.describe()],
            SOURCE,
        )
    ]
    if impl.operation_reason("unmerge") is None:
        impl.unmerge_adapters(case.model)
        with torch.no_grad():
            back = compare("logits", case.model(case.ids).logits, want, tol)
        out.append(
            none_of(
                f"{name}: unmerged experts, logits beyond tolerance of the float64 adapted model",
                [] if back.ok else [back.describe()],
                SOURCE,
            )
        )
    return out


def round_trip_verdict(case: MF.ArchCase, folder: Path, seed: int) -> Verdict:
    """Saved from ``case``, loaded into a model built the same way whose adapters hold other values."""
    impl = case.impl
    impl.save_adapter(case.model, folder)
    fresh = MF.build_case(impl, case.arch, case.dtype, case.ids.device, seed=seed)
    with torch.no_grad():
        for p in fresh.trained().values():
            p.neg_().add_(1.0)  # other values than the saved ones, whatever they were
    impl.load_adapter(fresh.model, folder)
    saved, now = case.trained(), impl.expert_adapters(fresh.model)
    bad = [f"{n} not adapted after the load" for n in case.experts if n not in now]
    for n, ex in now.items():
        if n in case.experts:
            bad += [
                f"{n}.{end}: not the saved values"
                for end, p in (("lora_A", ex.a), ("lora_B", ex.b))
                if not torch.equal(p.detach(), saved[f"{n}.{end}"].detach())
            ]
    # the reference of the tensors the model holds now (a loader may put new parameters in place of the old ones)
    fresh_case = dataclasses.replace(
        fresh, ids=case.ids, dlogits=case.dlogits, experts=now, adapters=impl.adapter_parameters(fresh.model)
    )
    with torch.no_grad():
        got = fresh.model(case.ids).logits
    logits = compare("logits", got, MF.reference_run(fresh_case, backward=False).logits, MF.model_tolerance(case))
    bad += [] if logits.ok else [logits.describe()]
    return none_of(
        f"{case.arch.name}: expert adapters saved and loaded into a fresh model, factors or logits not the saved ones",
        bad,
        SOURCE + "; round trip: PEFT's adapter_model.safetensors keys",
        shown=4,
    )


def judge(impl, arch: Architecture, dtype: torch.dtype, device, *, seed: int = 0) -> tuple[list[Verdict], str | None]:
    """The routing, merge and round-trip verdicts of ``arch``'s expert adapters (the caller checks that ``impl``
    adapts them: ``model_function.expert_reason``), and why the merge was not judged (None: it was)."""
    case = MF.build_case(impl, arch, dtype, device, seed=seed)
    folder = Path(tempfile.mkdtemp(prefix="lora-experts-"))
    try:
        out = [round_trip_verdict(case, folder, seed), routing_verdict(case)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out + merge_verdicts(case), merge_reason(case)


def experts_left_untrained(init: dict, final: dict, experts) -> tuple[int, list[str]]:
    """(experts judged, ``"<parameter>.lora_B expert e"`` of each whose factor training left bitwise at its start):
    ``init`` and ``final`` hold the adapters by canonical name, each expert factor as (E, ...) (``Prepared.canonical``),
    ``experts`` the adapted expert parameters' names. Over a whole run every expert is routed to (a run that never
    routes to one would say so here too); a stack whose expert adapters the optimizer never sees, or whose gradient
    never reaches them, leaves them all at their start."""
    judged, left = 0, []
    for name in experts:
        for end in ("lora_A", "lora_B"):
            key = f"{name}.{end}"
            for e in range(init[key].shape[0]):
                judged += 1
                if torch.equal(init[key][e], final[key][e]):
                    left.append(f"{key} expert {e}")
    return judged, left
