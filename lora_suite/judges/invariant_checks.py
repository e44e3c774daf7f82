"""Invariants of a correct LoRA layer beyond the parity grid (``docs/lora-spec.md`` cites where each comes from), each
judged on a probe block of *any* implementation (``lora_suite.engine.probes``) and returned as ``Verdict``s:

- initial state (LoRA §4.1; PEFT's ``init_lora_weights=True``): as ``inject`` leaves them, the adapters change
  nothing (ΔW = s·B·A = 0, so every output is the base's) and can learn (some adapter gradient is non-zero and all
  are finite: B = 0 with A random gives dB = s·dYᵀ(x Aᵀ) ≠ 0);
- adapter dtype: every adapter is made in ``AdapterSpec.adapter_dtype`` (the base weight's dtype where None), on
  the base's device;
- frozen base: after ``inject`` the adapters are trainable parameters of the model and nothing else is; after a
  backward no base parameter holds a gradient;
- targets that name no layer: ``inject`` refuses them (PEFT raises), instead of a model that trains nothing;
- inputs untouched: forward and backward leave the inputs and upstream gradients bitwise as they were;
- several forwards, one backward: the gradients are the sum of each forward's own (no state kept on the module
  between a forward and its backward);
- activation checkpointing (``torch.utils.checkpoint``, both modes): the recomputed forward gives the plain
  run's outputs and gradients;
- a merge that folds: after ``merge_adapters`` the function no longer depends on adapter tensors the model still
  holds (zeroing them leaves the merged function), so a merge that left the weights as they were cannot pass.

Each takes a probe and inputs and returns one Verdict; the quick tier's ``test_layer_invariants.py`` records them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.checkpoint import checkpoint

from lora_suite.engine import probes as P
from lora_suite.judges import probe_judge as PJ
from lora_suite.judges.layer_checks import PARITY_SOURCE, none_of
from lora_suite.judges.parity import compare
from lora_suite.measure.criteria import Verdict

INIT_SOURCE = "LoRA (arXiv 2106.09685) §4.1: B = 0 at the start, so ΔW = BA = 0; PEFT init_lora_weights=True"


def base_function(probe: P.Probe, inputs: P.ProbeInputs) -> P.ProbeRun:
    """The probe's function without its adapters, in float64 (the base model's)."""
    return PJ.reference(dataclasses.replace(probe, adapters={}), inputs, inputs_require_grad=False, backward=False)


def outputs_beyond(probe: P.Probe, inputs: P.ProbeInputs, want: P.ProbeRun) -> tuple[list[str], int]:
    """The probe's outputs now (no gradients) against ``want``'s, each within its parity tolerance: the ones beyond
    it, described, and how many were compared."""
    with torch.no_grad():
        got = P.run_probe(probe, inputs, inputs_require_grad=False, backward=False)
    tols = PJ.tolerances(probe, inputs)
    errs = [compare(n, g, r, tols[n]) for n, g, r in zip(P.OUTPUTS, got.outputs, want.outputs)]
    return [e.describe() for e in errs if not e.ok], len(errs)


def initial_outputs(probe: P.Probe, inputs: P.ProbeInputs) -> Verdict:
    """``probe`` built with ``randomise=False``: each output against the base-only function in float64."""
    bad, n = outputs_beyond(probe, inputs, base_function(probe, inputs))
    return none_of(
        f"at initialisation: outputs differ from the base model's (of {n})",
        bad,
        INIT_SOURCE + "; " + PARITY_SOURCE,
    )


def initial_gradients(probe: P.Probe, inputs: P.ProbeInputs) -> Verdict:
    """``probe`` built with ``randomise=False``: each adapted layer has a finite, non-zero adapter gradient."""
    got = P.run_probe(probe, inputs)
    layers: dict[str, list] = {}
    for name, g in got.adapter_grads.items():
        layers.setdefault(name.rsplit(".", 1)[0], []).append(g)
    bad = []
    for path, grads in layers.items():
        if any(g is None or not torch.isfinite(g).all() for g in grads):
            bad.append(f"{path}: a gradient missing or not finite")
        elif not any(bool((g != 0).any()) for g in grads):
            bad.append(f"{path}: dA and dB all zero")
    return none_of(
        f"at initialisation: adapted layers that cannot learn (of {len(layers)})",
        bad,
        INIT_SOURCE + " and A random: dB = s·dYᵀ(x Aᵀ) is non-zero from the first step",
    )


def adapter_dtypes(probe: P.Probe) -> Verdict:
    """Every adapter in the spec's ``adapter_dtype`` (the probe's base dtype where None), on the base's device."""
    want = probe.spec.adapter_dtype or probe.dtype
    device = next(iter(probe.weights.values())).device
    bad = [f"{n}: {p.dtype} on {p.device}" for n, p in probe.adapters.items() if p.dtype != want or p.device != device]
    return none_of(
        f"adapters not in the requested dtype {str(want).removeprefix('torch.')} (of {len(probe.adapters)})",
        bad,
        "AdapterSpec.adapter_dtype (PEFT's autocast_adapter_dtype keeps fp32 adapters over a 16-bit base)",
    )


def frozen_base(probe: P.Probe, inputs: P.ProbeInputs) -> Verdict:
    """After ``inject``: the trainable parameters are exactly the adapters; after a backward, no other parameter
    holds a gradient."""
    adapters = {id(p): n for n, p in probe.adapters.items()}
    params = dict(probe.block.named_parameters())
    bad = [
        f"{n} not a trainable parameter of the model"
        for n, p in probe.adapters.items()
        if not p.requires_grad or all(q is not p for q in params.values())
    ]
    bad += [f"{n} trainable" for n, p in params.items() if p.requires_grad and id(p) not in adapters]
    P.run_probe(probe, inputs)
    bad += [f"{n} got a gradient" for n, p in params.items() if id(p) not in adapters and p.grad is not None]
    return none_of(
        f"after inject: adapters not trainable, or base parameters trainable or given a gradient (of {len(params)})",
        bad,
        "LoRA §4: W0 frozen, only A and B trained; PEFT marks only adapter parameters trainable",
    )


NO_SUCH_TARGET = "no_such_proj"


def unmatched_targets(impl, shape: P.BlockShape, spec, dtype: torch.dtype, device) -> Verdict:
    """``inject`` with targets that name no layer of the model: refused (an error), never a model that then trains
    nothing while its loss falls no lower than the base's."""
    block = P.ProbeBlock(shape, device=device, dtype=dtype)
    try:
        adapted = list(impl.inject(block, dataclasses.replace(spec, targets=(NO_SUCH_TARGET,))))
    except Exception as exc:  # noqa: BLE001  (the refusal is the answer: it is named)
        refused, detail = True, f"refused: {type(exc).__name__}: {str(exc)[:160]}"
    else:
        trainable = sum(p.requires_grad for p in block.parameters())
        refused, detail = False, f"accepted: {len(adapted)} layer(s) adapted, {trainable} trainable parameter(s)"
    return Verdict(
        "inject with targets that name no layer: refused",
        refused,
        "==",
        True,
        "PEFT's inject_adapter raises 'Target modules ... not found in the base model'",
        detail,
    )


def inputs_untouched(probe: P.Probe, inputs: P.ProbeInputs) -> Verdict:
    """Forward and backward leave the inputs and the upstream gradients bitwise as they were."""
    before = [t.clone() for t in (inputs.x, inputs.x_o, inputs.x_m, *inputs.dys)]
    xs = [t.requires_grad_() for t in (inputs.x.detach(), inputs.x_o.detach(), inputs.x_m.detach())]
    torch.autograd.backward(probe.block(*xs), list(inputs.dys))
    names = list(P.INPUTS) + [f"d{o}" for o in P.OUTPUTS]
    after = [*xs, *inputs.dys]
    bad = [n for n, a, b in zip(names, after, before) if not torch.equal(a.detach(), b)]
    return none_of(
        f"forward and backward: inputs or upstream gradients changed in place (of {len(names)})",
        bad,
        "F.linear and autograd never write their inputs",
        sep=", ",
    )


def several_forwards(probe: P.Probe, inputs: P.ProbeInputs, other: P.ProbeInputs) -> Verdict:
    """Two forwards (``inputs``, then ``other``) and one backward of both: every adapter and input gradient is the
    sum of each forward's own, within the parity tolerance."""
    one, two = P.run_probe(probe, inputs), P.run_probe(probe, other)
    xs = [[t.detach().requires_grad_() for t in (i.x, i.x_o, i.x_m)] for i in (inputs, other)]
    for p in probe.adapters.values():
        p.grad = None
    outs = [probe.block(*x) for x in xs]  # both forwards before any backward
    torch.autograd.backward([*outs[0], *outs[1]], [*inputs.dys, *other.dys])
    tols = PJ.tolerances(probe, inputs)
    errs = [
        compare(f"d[{n}]", p.grad, one.adapter_grads[n].double() + two.adapter_grads[n].double(), tols[f"d[{n}]"])
        for n, p in probe.adapters.items()
    ]
    for k, name in enumerate(P.INPUTS):
        for x, run, label in ((xs[0][k], one, "first"), (xs[1][k], two, "second")):
            errs.append(compare(f"d{name} ({label})", x.grad, run.input_grads[k].double(), tols[f"d{name}"]))
    bad = [e.describe() for e in errs if not e.ok]
    return none_of(
        f"two forwards, one backward: gradients not the sum of each forward's (of {len(errs)})",
        bad,
        "autograd: each forward keeps its own saved tensors (ctx.save_for_backward), none on the module",
    )


def checkpointed(probe: P.Probe, inputs: P.ProbeInputs, use_reentrant: bool) -> Verdict:
    """The probe under ``torch.utils.checkpoint`` (its forward recomputed in the backward): outputs and every
    gradient against the plain run, within the parity tolerance."""
    plain = P.run_probe(probe, inputs)
    xs = [t.detach().requires_grad_() for t in (inputs.x, inputs.x_o, inputs.x_m)]
    for p in probe.adapters.values():
        p.grad = None
    outs = checkpoint(probe.block, *xs, use_reentrant=use_reentrant)
    torch.autograd.backward(outs, list(inputs.dys))
    got = P.ProbeRun(
        tuple(o.detach() for o in outs),
        tuple(x.grad for x in xs),
        {n: None if p.grad is None else p.grad.detach().clone() for n, p in probe.adapters.items()},
    )
    tols = PJ.tolerances(probe, inputs)
    have = got.tensors()
    errs = [compare(n, have[n], want.double(), tols[n]) for n, want in plain.tensors().items() if want is not None]
    bad = [e.describe() for e in errs if not e.ok]
    mode = "reentrant" if use_reentrant else "non-reentrant"
    return none_of(
        f"under {mode} activation checkpointing: tensors beyond tolerance of the plain run (of {len(errs)})",
        bad,
        "torch.utils.checkpoint recomputes the same forward; " + PARITY_SOURCE,
    )


def merge_folds(probe: P.Probe, inputs: P.ProbeInputs) -> Verdict:
    """After ``merge_adapters`` (``layer_checks.merged`` ran it on ``probe``): every adapter tensor the model still
    holds is zeroed, and the outputs must still be the unmerged function's (the merge put s·B·A into W)."""
    ref = PJ.reference(probe, inputs, inputs_require_grad=False, backward=False)  # before zeroing: it reads them
    left = probe.impl.adapter_parameters(probe.block)
    with torch.no_grad():
        for p in left.values():
            p.zero_()
    bad, n = outputs_beyond(probe, inputs, ref)
    return none_of(
        f"merged weights with the adapters left zeroed: outputs beyond tolerance (of {n}, {len(left)} left)",
        bad,
        "LoRA §4.1: W = W0 + BA computes the adapted function by itself; PEFT merge_and_unload",
    )
