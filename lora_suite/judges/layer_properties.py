"""The layer contract as properties over drawn cases (Hypothesis), for any implementation: where the grids of
``tiers/quick/test_layer_probes.py`` fix their values (scales such as 12/8 that are exact in bf16, bias-free
projections, a few ranks), these draw them, and a failure is shrunk to a minimal case printed with what reproduces it.

A case (``LayerCase``) is a probe block (``lora_suite.engine.probes``) of drawn widths, with or without a base bias
on every projection, a rank r in 1..256, an alpha drawn from the reals (so that s = alpha/r, or alpha/√r under
rsLoRA, is in general not representable in bf16 or fp16: a stack that rounds its scale through 16 bits, or keeps a
16-bit copy of it, is then off in its fp32 path), a dtype configuration (activations and adapters), a layout (2-D,
3-D, non-contiguous), a token count and a seed for every tensor. Three properties, each its own drawn run:

1. ``function``: outputs, input gradients, dA and dB within the error model's bound of the float64 function
   (``probe_judge.tolerances``; the derivation is ``docs/lora-spec.md``'s "Error model": an fp32 path is judged at fp32's
   roundoff, a 16-bit path at its own), in the dtypes F.linear and autograd give; and the base (weights and biases)
   bitwise untouched, not trainable, given no gradient;
2. ``merge``: where the implementation merges, every merged weight element is W + s·B·A rounded once
   (``lora_suite.judges.merge_rounding``);
3. ``non_finite``: a NaN or ±Inf in one token's input or upstream gradient reaches what F.linear and autograd say it
   reaches, and nothing else (``lora_suite.judges.non_finite_checks``).

Reproduce a printed case with ``check_case(impl, LayerCase(...), device)`` (``python -m`` examples in
``docs/verdicts.md``).
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from lora_suite.engine import probes as P
from lora_suite.implementations import LoRAImplementation
from lora_suite.judges import layer_checks as L
from lora_suite.judges import merge_rounding as MR
from lora_suite.judges import non_finite_checks as NF
from lora_suite.judges import probe_judge as PJ
from lora_suite.judges.hypothesis_profiles import (
    DrawnRun,
    Falsified,
    below_range,
    outside_the_contract,
    run_drawn,
)
from lora_suite.judges.layer_cases import (  # noqa: F401  (re-exported: LP.LayerCase is the printed reproduction)
    BF16,
    CONFIGS,
    MAX_RANK,
    LayerCase,
    Limits,
    bias_reason,
    cases,
    exact_in,
    explicit,
    ranks,
)
from lora_suite.measure.criteria import Verdict


def build(impl: LoRAImplementation, case: LayerCase, device) -> tuple[P.Probe, P.ProbeInputs]:
    """The case's probe and inputs. A case whose exact values leave the activation dtype's range (fp16 overflows at
    65504: a large s at r = 1 can take a gradient there) is outside the contract: rejected (``assume``), not judged."""
    dtype = case.dtypes()[0]
    probe = P.build_probe(impl, case.shape(), case.spec(), dtype, device, seed=case.seed)
    lead = (case.tokens,) if case.layout != "3d" else (1, case.tokens)
    layout = "2d" if case.layout == "3d" else case.layout
    inputs = P.random_inputs(case.shape(), lead, dtype, device, layout=layout, seed=case.seed + 1)
    if not in_range(probe, inputs):
        outside_the_contract(f"{case!r}: its values leave {dtype}'s range")
    return probe, inputs


def in_range(probe: P.Probe, inputs: P.ProbeInputs) -> bool:
    """Whether every tensor's terms (``probe_judge.absolute_reference``) stay ``RANGE_MARGIN`` below the dtype's max. Only
    fp16 can be left: the drawn terms stay many orders below fp32's and bf16's max (3e38), so those are not computed."""
    if inputs.x.dtype != torch.float16:
        return True
    terms = PJ.absolute_reference(probe, inputs).tensors().values()
    return below_range((float(t.abs().max()) for t in terms if t is not None), inputs.x.dtype)


def _frozen_snapshot(probe: P.Probe) -> dict[str, torch.Tensor]:
    mine = {id(p) for p in probe.adapters.values()}
    named = list(probe.block.named_parameters()) + list(probe.block.named_buffers())
    return {n: t.detach().clone() for n, t in named if id(t) not in mine}


def function(impl: LoRAImplementation, case: LayerCase, device) -> None:
    """Property 1 (module docstring); raises ``Falsified`` naming what broke."""
    probe, inputs = build(impl, case, device)
    before = _frozen_snapshot(probe)
    got, errs = L.parity_errors(probe, inputs)
    bad = [e.describe() for e in errs if not e.ok] + PJ.dtype_errors(probe, inputs, got)
    mine = {id(p) for p in probe.adapters.values()}
    for n, p in probe.block.named_parameters():
        if id(p) not in mine and (p.requires_grad or p.grad is not None):
            bad.append(f"base parameter {n} trainable or given a gradient")
    after = dict(list(probe.block.named_parameters()) + list(probe.block.named_buffers()))
    bad += [f"base tensor {n} changed" for n, t in before.items() if n in after and not torch.equal(after[n], t)]
    if bad:
        raise Falsified(f"s = {case.scale()!r}: " + "; ".join(bad[:4]))


def merge(impl: LoRAImplementation, case: LayerCase, device) -> None:
    """Property 2: every merged weight element W + s·B·A rounded once (bias-free cases only: see merge_rounding)."""
    if case.bias:
        return
    probe, _ = build(impl, case, device)
    v = MR.merged_rounding(probe)
    if not v.passed:
        raise Falsified(f"s = {case.scale()!r}: {v.detail}")


SITE_KINDS = ("input", "upstream", "lora_A", "lora_B")  # where the general non-finite case poisons (NF.sites)


def site_of(probe: P.Probe, kind: str, i: int, value: float) -> str:
    """The ``i``-th (mod their count) poison site of ``kind`` in ``probe`` where ``value`` is judged (±Inf: linear
    sites only, ``non_finite_checks.linear_site``)."""
    if kind not in SITE_KINDS:
        raise ValueError(f"site kind {kind!r} is not one of {SITE_KINDS}")
    prefix = {"input": tuple(P.INPUTS), "upstream": ("dy:",)}.get(kind)
    pool = [
        site
        for site in NF.sites(probe)
        if (site.startswith(prefix) if prefix else site.endswith(f".{kind}"))
        and (math.isnan(value) or NF.linear_site(site))
    ]
    return pool[i % len(pool)]


def non_finite(
    impl: LoRAImplementation, case: LayerCase, device, value: float, token: int, site: tuple[str, int] = ("lora_B", 0)
) -> None:
    """Property 3: ``value`` in token ``token`` (mod the count) of the input, then of q's upstream gradient (the
    attention's fixed cases); then in one element (``token``) of the drawn ``site`` (kind, index): every tensor's
    non-finite elements the float64 function's (``non_finite_checks.poisoned_anywhere``)."""
    probe, inputs = build(impl, case, device)
    t = token % case.tokens
    bad = []
    for check in (NF.poisoned_input, NF.poisoned_upstream):
        v = check(probe, inputs, value, t)
        if not v.passed:
            bad.append(f"{v.name.split(':')[0]} (token {t}): {v.detail}")
    where = site_of(probe, site[0], site[1], value)
    v = NF.poisoned_anywhere(probe, inputs, where, token, value)
    if not v.passed:
        bad.append(f"{v.name.split(': tensors')[0]} (element {token}): {v.detail}")
    if bad:
        raise Falsified("; ".join(bad))


def merge_reason(impl: LoRAImplementation, limits: Limits) -> str | None:
    """Why the merge property does not apply to ``impl``."""
    if limits.nf4:
        return f"{impl.name}'s base is always 4-bit: merging re-quantises it"
    return impl.merge_reason()


NAMES = {
    "function": "layer properties: drawn cases off the float64 function, or with the base changed, trainable or "
    "given a gradient",
    "merge": "layer properties: drawn cases whose merged weights are not W + s·B·A rounded once",
    "non_finite": "layer properties: drawn cases where a NaN/Inf did not reach what it must, or reached more",
}
SOURCES = {
    "function": "the float64 function within the error model of docs/lora-spec.md; LoRA §4 (W0 frozen)",
    "merge": MR.SOURCE,
    "non_finite": NF.SOURCE,
}
POISONS = (math.nan, math.inf, -math.inf)


TALLIED = (  # what run_property counts: the classes the fixed grids miss, each a coverage check of the quick tier
    "scale inexact in bf16",
    "base bias",
    "rank of 128 or more",
    "rank above a layer's smaller width",
    "square block",
    "per-module rank and alpha",
)


def run_property(name: str, impl: LoRAImplementation, limits: Limits, device, *, scale: float = 1.0) -> DrawnRun:
    """One property's drawn run (``hypothesis_profiles.run_drawn``) for ``impl`` within ``limits``; its tally counts
    the cases of each class the fixed grids miss (``TALLIED``) that the property judged (merge: bias-free cases only)."""
    drawn, fixed = cases(limits), explicit(limits)
    tally = dict.fromkeys(TALLIED, 0)

    def counted(case: LayerCase) -> LayerCase:
        if name == "merge" and case.bias:
            return case
        widths = (case.hidden, case.q_out, case.kv_out, case.intermediate)
        tally["scale inexact in bf16"] += not exact_in(case.scale(), BF16)
        tally["base bias"] += case.bias
        tally["rank of 128 or more"] += case.r >= 128
        tally["rank above a layer's smaller width"] += case.r > min(widths)
        tally["square block"] += len(set(widths)) == 1
        tally["per-module rank and alpha"] += case.pattern
        return case

    if name == "non_finite":
        site = st.tuples(st.sampled_from(SITE_KINDS), st.integers(0, 1 << 6))
        poison = st.tuples(drawn, st.sampled_from(POISONS), st.integers(0, 1 << 10), site)
        run = run_drawn(
            lambda c: non_finite(impl, counted(c[0]), device, c[1], c[2], c[3]),
            poison,
            scale=scale,
            # a NaN in each adapter, whatever is drawn: an Inf cleaned to the largest float overflows back to Inf
            # through the product, so only a NaN shows a stack that cleans its adapters (mutate's survivor on the
            # example, run 20261208T002733Z-mutate-plain_lora_make: nan_to_num on A cast to the activation dtype)
            explicit=[
                (fixed[0], math.nan, 0, ("lora_B", 0)),
                (fixed[0], math.nan, 3, ("lora_A", 0)),
                (fixed[-1], math.inf, 5, ("lora_A", 1)),
            ],
        )
    else:
        body = {"function": function, "merge": merge}[name]
        run = run_drawn(lambda c: body(impl, counted(c), device), drawn, scale=scale, explicit=fixed)
    run.tally = tally
    return run


def verdict_of(name: str, run: DrawnRun) -> Verdict:
    """The check of one property's run: 0 minimal failing cases (of the cases judged), or 1 with the shrunk case, why
    it failed and Hypothesis' lines that reproduce it in the detail."""
    n, failed, source = run.cases, int(run.failure is not None), SOURCES[name]
    detail = "" if run.failure is None else f"{run.failure} | {run.reproduce}".strip(" |")
    if name == "function":
        return Verdict(
            f"layer properties: drawn cases off the float64 function, or with the base changed, trainable or given a "
            f"gradient (of {n} drawn)",
            failed,
            "==",
            0,
            source,
            detail,
        )
    if name == "merge":
        return Verdict(
            f"layer properties: drawn cases whose merged weights are not W + s·B·A rounded once (of {n} drawn)",
            failed,
            "==",
            0,
            source,
            detail,
        )
    return Verdict(
        f"layer properties: drawn cases where a NaN/Inf did not reach what it must, or reached more (of {n} drawn)",
        failed,
        "==",
        0,
        source,
        detail,
    )


def check_case(impl: LoRAImplementation, case: LayerCase, device="cpu") -> list[str]:
    """Rerun one printed case through the three properties (merge where the implementation merges): what broke, empty
    when nothing did."""
    out = []
    for name, body in (("function", function), ("merge", merge)):
        if name == "merge" and impl.merge_reason():
            continue
        try:
            body(impl, case, device)
        except Falsified as exc:
            out.append(f"{name}: {exc}")
    try:
        non_finite(impl, case, device, math.nan, 0)
    except Falsified as exc:
        out.append(f"non_finite: {exc}")
    return out
