"""The verdicts of one option case (``option_cases``) for any implementation: what the settings ask for is what the
stack built, computes, trains, merges and saves.

In order (``judge``):

1. **placement**: the adapted modules are exactly those the settings name (``option_cases.expected_paths``: a layer
   left out of ``layers_to_transform`` adapted, or a listed one left bare, fails); each option leaves its tensors
   (a B bias on every adapted linear, a magnitude under DoRA, a copy of every parameter of a saved module);
2. **the start** (init options and DoRA), before anything is randomised: gaussian A has the mean and spread of
   N(0, (1/r)²) and B is zero; init False draws B ≠ 0 and the model is not its base; PiSSA's s·B·A is the top-r part of
   W's SVD (OLoRA's B·A is Q_r·R_r of W = Q·R), the base holds W − s·B·A and the model computes its base function;
   DoRA's m starts at ‖W‖ of each output row;
3. **the function**: after every tensor the stack trains is randomised, the logits and every gradient (adapters and
   options) against ``option_reference``; nothing else trainable or given a gradient (a saved module's original
   included);
4. **a step**: one SGD step over whatever is trainable leaves every base tensor bitwise as inject left it, and the
   model computes the float64 function of its new tensors;
5. **merge, unmerge** (where the stack offers them): the model computes the same function after each;
6. **the round trip**: ``save_adapter``, a fresh model adapted with the same settings, ``load_adapter``: the same
   logits bit for bit and every tensor back.

Tolerances: ``model_function.model_tolerance``'s error model for the architecture (fp32 here); statistical bounds
for the spread at 6 standard errors (a false alarm about once in 10⁹ draws, a wrong variance of 1/in instead of 1/r²
is tens of standard errors away at these sizes).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from lora_suite.implementations import ImplementationError
from lora_suite.implementations.peft_names import SAVED
from lora_suite.judges import option_cases as OC
from lora_suite.judges import option_reference as REF
from lora_suite.judges.layer_checks import none_of
from lora_suite.judges.model_function import arch_tolerance
from lora_suite.judges.parity import compare
from lora_suite.measure.criteria import Verdict

SOURCE = "PEFT's LoraConfig options as option_reference.py computes them in float64; option_cases.py's table"
STEP_LR = 0.5


def model_tolerance(case: OC.OptionCase) -> float:
    return arch_tolerance(case.arch, torch.float32, case.ids.numel())


def placement(case: OC.OptionCase) -> list[Verdict]:
    got, want = set(OC.adapted_paths(case)), OC.expected_paths(case)
    wrong = [f"{p} not adapted" for p in want if p not in got] + [f"{p} adapted" for p in sorted(got - set(want))]
    need = []
    for path in want:
        if case.spec.lora_bias:
            need.append(f"{path}.lora_bias")
        if case.spec.use_dora:
            need.append(f"{path}.lora_magnitude")
    for leaf in case.spec.modules_to_save:
        for path, m in case.reference.named_modules():
            if path.rsplit(".", 1)[-1] == leaf:
                need += [f"{path}{SAVED}{n}" for n, _ in m.named_parameters()]
    return [
        none_of(f"{case.name}: adapted modules other than the settings name", wrong, SOURCE, sep=", ", shown=4),
        none_of(
            f"{case.name}: tensors the option must add that the stack does not hold",
            [n for n in need if n not in case.options],
            SOURCE + "; peft_names.py: the canonical names",
            sep=", ",
            shown=4,
        ),
    ]


def _spread(values: torch.Tensor, std: float) -> list[str]:
    n = values.numel()
    mean, sd = float(values.double().mean()), float(values.double().std())
    bad = [f"mean {mean:.4g} (expected 0 ± {6 * std / n**0.5:.3g})"] if abs(mean) > 6 * std / n**0.5 else []
    if abs(sd / std - 1) > 6 / (2 * n) ** 0.5:
        bad.append(f"standard deviation {sd:.4g} (expected {std:.4g} ± {6 / (2 * n) ** 0.5:.1%})")
    return bad


def start(case: OC.OptionCase) -> list[Verdict]:
    """The init options and DoRA's magnitude, read as inject left them (module docstring, 2)."""
    init = case.spec.init
    paths = [p for p in OC.adapted_paths(case) if f"{p}.lora_A" in case.adapters]
    name, bad = case.name, []
    held = {n: at_inject(case, p) for n, p in case.held.items()}
    if init == "gaussian":
        bad = _spread(torch.cat([held[f"{p}.lora_A"].flatten() for p in paths]), 1 / case.spec.r)
        bad += [f"{p}.lora_B not zero" for p in paths if bool(held[f"{p}.lora_B"].any())]
    elif init == "random_b":
        bad = [f"{p}.lora_B all zero" for p in paths if not bool(held[f"{p}.lora_B"].any())]
        with torch.no_grad():
            moved = compare(
                "logits at the start", case.model(case.ids).logits, REF.base_logits(case), model_tolerance(case)
            )
        bad += ["the model computes its base function at the start (a no-op init)"] if moved.ok else []
    elif init in ("pissa", "olora"):
        bad = _residual(case, paths, held)
    if case.spec.use_dora:
        for p in paths:
            w = case.reference.get_parameter(f"{p}.weight")
            err = compare(f"{p}.lora_magnitude", held[f"{p}.lora_magnitude"], w.norm(dim=1), model_tolerance(case))
            bad += [] if err.ok else [err.describe()]
    if init == "default" and not case.spec.use_dora:
        return []
    return [
        none_of(f"{name}: the adapters as the init leaves them", bad, SOURCE + "; option_cases.py's table", shown=4)
    ]


def _residual(case: OC.OptionCase, paths: list[str], held: dict[str, torch.Tensor]) -> list[str]:
    """PiSSA / OLoRA: the adapters' product from W's SVD / QR, the base W − s·B·A, the base function at the start."""
    tol, bad = model_tolerance(case), []
    for p in paths:
        w, r = case.reference.get_parameter(f"{p}.weight"), case.spec.rank_of(p.rsplit(".", 1)[-1])
        s = case.spec.scale_of(p.rsplit(".", 1)[-1])
        ba = held[f"{p}.lora_B"].double() @ held[f"{p}.lora_A"].double()
        if case.spec.init == "pissa":
            u, sv, vh = torch.linalg.svd(w, full_matrices=False)
            want, got = (u[:, :r] * sv[:r]) @ vh[:r], s * ba
        else:
            q, rr = torch.linalg.qr(w)
            want, got = q[:, :r] @ rr[:r], ba
        err = compare(f"{p}: the adapters' product", got, want, tol)
        bad += [] if err.ok else [err.describe()]
        err = compare(f"{p}: the base weight", at_inject(case, base_weight(case, p)), w - s * ba, tol)
        bad += [] if err.ok else [err.describe()]
    with torch.no_grad():
        logits = case.model(case.ids).logits
    err = compare("logits at the start", logits, REF.base_logits(case), tol)
    return bad + ([] if err.ok else [f"{err.describe()} (not the base function)"])


def base_now(case: OC.OptionCase) -> dict[str, torch.Tensor]:
    """The base weight each adapted linear held right after inject, in float64, where the init replaced it (PiSSA,
    OLoRA): the snapshot, so that a merge that wrote into the weight since is not counted twice."""
    if case.spec.init not in ("pissa", "olora"):
        return {}
    return {f"{p}.weight": at_inject(case, base_weight(case, p)).double() for p in OC.adapted_paths(case)}


def base_weight(case: OC.OptionCase, path: str) -> torch.Tensor:
    """The live base weight of the adapted module at ``path`` (a PEFT layer's ``base_layer``, else its own)."""
    layer = case.model.get_submodule(path)
    weight = getattr(layer, "base_layer", layer).weight
    assert isinstance(weight, torch.Tensor), f"{path}: an adapted module's base weight is a parameter"
    return weight


def at_inject(case: OC.OptionCase, param: torch.Tensor) -> torch.Tensor:
    """The value the model's parameter ``param`` held right after inject (``OptionCase.after_inject``)."""
    name = next(n for n, p in case.model.named_parameters() if p is param)
    return case.after_inject[name]


def _run(case: OC.OptionCase):
    for p in case.model.parameters():
        p.grad = None
    logits = case.model(case.ids).logits
    (logits * case.dlogits.to(logits.dtype)).sum().backward()
    return logits.detach()


def function(case: OC.OptionCase) -> list[Verdict]:
    """Logits and every trained tensor's gradient against float64; nothing else trainable or given a gradient."""
    tol, held = model_tolerance(case), {id(p) for p in case.held.values()}
    others = {n: p for n, p in case.model.named_parameters() if id(p) not in held}
    trainable = [f"{n} trainable" for n, p in others.items() if p.requires_grad]
    got, want = _run(case), REF.reference(case, base=base_now(case))
    graded = [f"{n} got a gradient" for n, p in others.items() if p.grad is not None]
    logits = compare("logits", got, want.logits, tol)
    errs = [compare(n, case.held[n].grad, g, 2 * tol) for n, g in want.grads.items()]
    return [
        none_of(
            f"{case.name}: logits beyond tolerance of the float64 adapted model",
            [] if logits.ok else [logits.describe()],
            SOURCE,
        ),
        none_of(
            f"{case.name}: gradients of the adapter and option tensors beyond tolerance (of {len(errs)})",
            [e.describe() for e in errs if not e.ok],
            SOURCE + "; x2 for the backward",
            shown=4,
        ),
        none_of(
            f"{case.name}: base parameters trainable or given a gradient (of {len(others)})",
            trainable + graded,
            "LoRA §4: W0 frozen; a saved module's original kept (PEFT's ModulesToSaveWrapper)",
            shown=4,
        ),
    ]


def step(case: OC.OptionCase) -> list[Verdict]:
    """One SGD step over whatever is trainable: the base as inject left it, and the float64 function of the rest."""
    held = {id(p) for p in case.held.values()}
    with torch.no_grad():
        for p in case.model.parameters():
            if p.requires_grad and p.grad is not None:
                p.add_(p.grad, alpha=-STEP_LR)
    moved = [
        n
        for n, p in case.model.named_parameters()
        if id(p) not in held and not torch.equal(p.detach(), case.after_inject[n])
    ]
    return [
        none_of(f"{case.name}: base parameters changed by a training step", moved, SOURCE, sep=", ", shown=4),
        _same_function(case, "after a step"),
    ]


def _same_function(case: OC.OptionCase, when: str) -> Verdict:
    with torch.no_grad():
        got = case.model(case.ids).logits
    err = compare("logits", got, REF.reference(case, backward=False, base=base_now(case)).logits, model_tolerance(case))
    return none_of(
        f"{case.name}: {when}, logits beyond tolerance of the float64 adapted model",
        [] if err.ok else [err.describe()],
        SOURCE,
    )


def merged(case: OC.OptionCase) -> tuple[list[Verdict], list[tuple[str, str]]]:
    """Merge, then unmerge, each where the stack offers it: the same function after each. Returns the verdicts and
    the (operation, reason) pairs of what the stack does not offer."""
    out, skipped = [], []
    for op, call in (("merge", case.impl.merge_adapters), ("unmerge", case.impl.unmerge_adapters)):
        if why := case.impl.operation_reason(op):
            skipped.append((op, why))
            break
        call(case.model)
        out.append(_same_function(case, f"after {op}"))
    return out, skipped


def round_trip(case: OC.OptionCase, device) -> Verdict:
    """Save, a fresh model with the same settings, load: the same logits bit for bit, every tensor back."""
    with torch.no_grad():
        want = case.model(case.ids).logits
    with tempfile.TemporaryDirectory() as tmp:
        case.impl.save_adapter(case.model, Path(tmp) / "adapter")
        fresh = OC.build(case.impl, case.name, device, seed=case.seed)
        try:
            case.impl.load_adapter(fresh.model, Path(tmp) / "adapter")
        except ImplementationError as exc:  # the stack refused the folder it wrote: nothing restored
            return _restored(case, [f"load_adapter refused the folder save_adapter wrote: {exc}"])
    with torch.no_grad():
        got = fresh.model(case.ids).logits
    names = {**case.impl.adapter_parameters(fresh.model), **case.impl.option_parameters(fresh.model)}
    lost = [n for n, p in case.held.items() if n not in names or not torch.equal(names[n].detach(), p.detach())]
    lost += [] if torch.equal(got, want) else [f"logits differ by up to {float((got - want).abs().max()):.3g}"]
    return _restored(case, lost)


def _restored(case: OC.OptionCase, lost: list[str]) -> Verdict:
    return none_of(f"{case.name}: tensors or logits not restored by save and load", lost, SOURCE + "; round_trip.py")


def judge(impl, name: str, device, *, seed: int = 0) -> tuple[list[Verdict], list[tuple[str, str]]]:
    """Every verdict of option ``name`` for ``impl`` (its applicability checked by the caller), and what was not
    applicable within the case (operations the stack does not offer) with the stack's reasons."""
    case = OC.build(impl, name, device, seed=seed)
    verdicts = placement(case) + start(case)
    OC.randomise(case)
    verdicts += function(case) + step(case)
    verdicts.append(round_trip(case, device))
    more, skipped = merged(case)
    return verdicts + more, skipped


def not_applicable_reason(impl, name: str) -> str | None:
    """Why option ``name`` is not judged on ``impl``: the option's feature, or what its architecture needs, as the
    stack declares it (``model_function.unquantised_reason``)."""
    from lora_suite.engine.architectures import ARCHITECTURES
    from lora_suite.judges.model_function import unquantised_reason as arch_reason

    option = OC.OPTIONS[name]
    if why := impl.reason_not_applicable(option.feature):
        return f"{option.feature}: {why}"
    return arch_reason(impl, ARCHITECTURES[option.arch])
