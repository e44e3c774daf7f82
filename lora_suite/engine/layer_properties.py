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
   (``lora_suite.engine.merge_rounding``);
3. ``non_finite``: a NaN or ±Inf in one token's input or upstream gradient reaches what F.linear and autograd say it
   reaches, and nothing else (``lora_suite.engine.non_finite_checks``).

Reproduce a printed case with ``check_case(impl, LayerCase(...), device)`` (``python -m`` examples in
``docs/verdicts.md``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from lora_suite.engine import layer_checks as L
from lora_suite.engine import merge_rounding as MR
from lora_suite.engine import non_finite_checks as NF
from lora_suite.engine import probe_judge as PJ
from lora_suite.engine import probes as P
from lora_suite.engine.hypothesis_profiles import DrawnRun, Falsified, run_drawn
from lora_suite.implementations import AdapterSpec, LoRAImplementation
from lora_suite.measure.criteria import Verdict

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CONFIGS = {  # name: (activation and base dtype, adapter dtype), as the probe grids name them
    "fp32": (F32, F32),
    "fp16": (F16, F16),
    "bf16": (BF16, BF16),
    "fp16-act+fp32-adapters": (F16, F32),
    "bf16-act+fp32-adapters": (BF16, F32),
}
LAYOUTS = ("2d", "3d", "noncontig")
MAX_RANK = 256


@dataclass(frozen=True)
class LayerCase:
    """One drawn case; its ``repr`` is the Python that rebuilds it."""

    config: str
    hidden: int
    q_out: int
    kv_out: int
    intermediate: int
    tokens: int
    layout: str
    r: int
    alpha: float
    rslora: bool
    bias: bool
    seed: int
    nf4: bool = False  # the implementation's own 4-bit base (one that has no 16-bit base)

    def shape(self) -> P.BlockShape:
        return P.BlockShape("drawn", self.hidden, self.q_out, self.kv_out, self.intermediate, self.bias)

    def dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        return CONFIGS[self.config]

    def spec(self) -> AdapterSpec:
        adapter = self.dtypes()[1]
        return AdapterSpec(P.PROBE_TARGETS, self.r, self.alpha, self.rslora, adapter, "nf4" if self.nf4 else None)

    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


def exact_in(value: float, dtype: torch.dtype) -> bool:
    """Whether ``value`` is representable in ``dtype`` (its round trip through it gives it back)."""
    return float(torch.tensor(value, dtype=torch.float64).to(dtype).double()) == value


@dataclass(frozen=True)
class Limits:
    """What an implementation lets the properties draw (from its ``not_applicable``) and how large: the CPU self-tests
    use tiny widths, the quick tier on a GPU wider ones."""

    configs: tuple[str, ...]
    rslora: bool
    bias: bool
    nf4: bool
    two_d: bool
    max_width: int
    max_tokens: int

    @classmethod
    def of(cls, impl: LoRAImplementation, max_width: int = 64, max_tokens: int = 40) -> Limits:
        mixed = impl.reason_not_applicable("fp32_adapters_on_16bit_base") is None
        configs = tuple(c for c, (act, ad) in CONFIGS.items() if mixed or act == ad)
        nf4 = impl.reason_not_applicable("bf16_base") is not None
        return cls(
            configs,
            impl.reason_not_applicable("rslora") is None,
            bias_reason(impl) is None and not nf4,
            nf4,
            impl.reason_not_applicable("inputs_2d") is None,
            max_width,
            max_tokens,
        )


def bias_reason(impl: LoRAImplementation) -> str | None:
    """Why the implementation takes no base bias (its ``linear_bias`` feature)."""
    return impl.reason_not_applicable("linear_bias")


def cases(limits: Limits) -> st.SearchStrategy[LayerCase]:
    """Drawn cases within ``limits``; widths in NF4's blocks of 64 where the base is 4-bit."""
    if limits.nf4:
        width = st.integers(1, max(1, limits.max_width // 64)).map(lambda k: 64 * k)
    else:
        width = st.integers(1, limits.max_width)
    return st.builds(
        LayerCase,
        config=st.sampled_from(limits.configs),
        hidden=width,
        q_out=width,
        kv_out=width,
        intermediate=width,
        tokens=st.integers(2, limits.max_tokens),
        layout=st.sampled_from(LAYOUTS if limits.two_d else ("3d",)),
        r=st.integers(1, MAX_RANK),
        alpha=st.floats(0.05, 128.0, allow_nan=False, allow_infinity=False),
        rslora=st.booleans() if limits.rslora else st.just(False),
        bias=st.booleans() if limits.bias else st.just(False),
        seed=st.integers(0, 2**16 - 1),
        nf4=st.just(limits.nf4),
    )


def explicit(limits: Limits) -> list[LayerCase]:
    """Cases run first whatever is drawn: a scale inexact in bf16 and fp16 (7.3 / 3) in the first configuration and,
    where a bias is taken, on a biased block; so that every run judges both classes."""
    w = 64 if limits.nf4 else 37
    base = LayerCase(limits.configs[0], w, w, w, w, 5, "3d", 3, 7.3, False, limits.bias, 11, limits.nf4)
    return [base, LayerCase(**{**asdict(base), "config": limits.configs[-1], "seed": 12})]


RANGE_MARGIN = 16.0  # a case is in range when every sum's terms stay 16x below the dtype's largest finite value


def build(impl: LoRAImplementation, case: LayerCase, device) -> tuple[P.Probe, P.ProbeInputs]:
    """The case's probe and inputs. A case whose exact values leave the activation dtype's range (fp16 overflows at
    65504: a large s at r = 1 can take a gradient there) is outside the contract: rejected (``assume``), not judged."""
    dtype = case.dtypes()[0]
    probe = P.build_probe(impl, case.shape(), case.spec(), dtype, device, seed=case.seed)
    lead = (case.tokens,) if case.layout != "3d" else (1, case.tokens)
    layout = "2d" if case.layout == "3d" else case.layout
    inputs = P.random_inputs(case.shape(), lead, dtype, device, layout=layout, seed=case.seed + 1)
    if not in_range(probe, inputs):
        if currently_in_test_context():
            assume(False)
        raise ValueError(f"{case!r}: its values leave {dtype}'s range (by {RANGE_MARGIN}x margin): not a case to judge")
    return probe, inputs


def in_range(probe: P.Probe, inputs: P.ProbeInputs) -> bool:
    """Whether every tensor's terms (``probe_judge.absolute_reference``) stay ``RANGE_MARGIN`` below the dtype's max. Only
    fp16 can be left: the drawn terms stay many orders below fp32's and bf16's max (3e38), so those are not computed."""
    if inputs.x.dtype != torch.float16:
        return True
    top = torch.finfo(inputs.x.dtype).max / RANGE_MARGIN
    terms = PJ.absolute_reference(probe, inputs).tensors().values()
    return all(float(t.abs().max()) < top for t in terms if t is not None)


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


def non_finite(impl: LoRAImplementation, case: LayerCase, device, value: float, token: int) -> None:
    """Property 3: ``value`` in token ``token`` (mod the count) of the input, then of q's upstream gradient."""
    probe, inputs = build(impl, case, device)
    t = token % case.tokens
    bad = []
    for check in (NF.poisoned_input, NF.poisoned_upstream):
        v = check(probe, inputs, value, t)
        if not v.passed:
            bad.append(f"{v.name.split(':')[0]} (token {t}): {v.detail}")
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


def run_property(name: str, impl: LoRAImplementation, limits: Limits, device, *, scale: float = 1.0) -> DrawnRun:
    """One property's drawn run (``hypothesis_profiles.run_drawn``) for ``impl`` within ``limits``; its tally counts
    the cases whose scale is inexact in bf16 and those with a base bias (what the run judged, not what it skipped)."""
    drawn, fixed = cases(limits), explicit(limits)
    tally = {"scale inexact in bf16": 0, "base bias": 0}

    def counted(case: LayerCase) -> LayerCase:
        tally["scale inexact in bf16"] += not exact_in(case.scale(), BF16)
        tally["base bias"] += case.bias
        return case

    if name == "non_finite":
        poison = st.tuples(drawn, st.sampled_from(POISONS), st.integers(0, 1 << 10))
        run = run_drawn(
            lambda c: non_finite(impl, counted(c[0]), device, c[1], c[2]),
            poison,
            scale=scale,
            explicit=[(fixed[0], math.nan, 0)],
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
    """Rerun one printed case through the three properties: what broke, empty when nothing did."""
    out = []
    for name, body in (("function", function), ("merge", merge)):
        try:
            body(impl, case, device)
        except Falsified as exc:
            out.append(f"{name}: {exc}")
    try:
        non_finite(impl, case, device, math.nan, 0)
    except Falsified as exc:
        out.append(f"non_finite: {exc}")
    return out
