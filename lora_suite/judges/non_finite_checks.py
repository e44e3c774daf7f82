"""Non-finite values reach the adapters' outputs and gradients, never cleaned on the way: a stack that replaces NaN/Inf
(``torch.nan_to_num`` on an input, an output or a gradient, a clamp, a "skip the bad batch" inside the layer) turns a
diverging run into one that looks healthy, and the trainer's guard (``lora_suite.engine.non_finite``) then has nothing
to report.

What F.linear and autograd give, for one LoRA projection p(x) = x Wᵀ + b + s·(x Aᵀ) Bᵀ with token t's input or
upstream gradient poisoned (one element set to NaN or ±Inf):

- an input x[t, j]: the outputs of token t are non-finite (x Wᵀ already is); the adapters' gradients are too, since
  dA = s·(dy B)ᵀ x reads column j of x and dB = s·dyᵀ (x Aᵀ) reads row t of h = x Aᵀ; the other tokens' outputs and
  the adapters of projections that never saw x stay finite;
- an upstream gradient dy[t, c] of one output: that output's adapters' gradients are non-finite (dB row c,
  dA through dy B) and so is token t's input gradient (dy W); every other adapter's gradient and every other token's
  input gradient stays finite;
- anywhere (``poisoned_anywhere``, the general property the two above are instances of): one element of any input,
  upstream gradient or adapter (A or B of any projection) poisoned, every tensor that crosses the layer (outputs,
  input gradients, dA, dB) must be non-finite exactly where the float64 function of the same poisoned tensors is
  (``probe_judge.reference``, none of the code under test), element by element. A NaN in B[c, k] reaches every
  token's output c, every element of dx (through s·(dy B) A) and row k of dA, and leaves dB finite; a NaN in A[k, j]
  reaches every output and column j of dx and column k of dB. So a stack that cleans only the LoRA path's share of a
  tensor (``nan_to_num`` on the gradient it returns to its input, where dy W would keep a NaN of dy visible) fails
  here. A NaN propagates through every operation the same way whatever order a stack computes in; ±Inf only through
  the linear maps (Inf − Inf and silu(−Inf) may give NaN or a limit by formula), so ±Inf is placed only where the path
  to every tensor is linear: the attention's inputs, upstream gradients and adapters.
"""

from __future__ import annotations

import math

import torch

from lora_suite.engine import probes as P
from lora_suite.judges import probe_judge as PJ
from lora_suite.judges.layer_checks import none_of
from lora_suite.measure.criteria import Verdict

SOURCE = "F.linear and autograd propagate NaN/Inf; a stack must not replace them (non_finite_checks.py)"
ATTN_INPUT = ("q_proj", "k_proj", "v_proj")  # the projections that read x


def _finite(t: torch.Tensor | None) -> bool:
    return t is not None and bool(torch.isfinite(t).all())


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _poisoned(t: torch.Tensor, token: int, value: float) -> torch.Tensor:
    """A contiguous copy of ``t`` with token ``token``'s second feature (its first where there is one) set to ``value``."""
    out = t.detach().clone(memory_format=torch.contiguous_format)
    out.view(-1, out.shape[-1])[token, min(1, out.shape[-1] - 1)] = value
    return out


def _adapter_grads_reached(run: P.ProbeRun, leaves: tuple[str, ...]) -> list[str]:
    """What is wrong with the adapters' gradients: those of the projections ``leaves`` (the poison's path) must hold a
    non-finite value, every other adapter's must be finite."""
    seen = {n: g for n, g in run.adapter_grads.items() if n.rsplit(".", 2)[-2] in leaves}
    bad = [f"d[{n}] finite (or missing)" for n, g in seen.items() if g is None or bool(torch.isfinite(g).all())]
    return bad + [f"d[{n}] not finite" for n, g in run.adapter_grads.items() if n not in seen and not _finite(g)]


def poisoned_input(probe: P.Probe, inputs: P.ProbeInputs, value: float = math.nan, token: int = 0) -> Verdict:
    """x's token ``token`` poisoned with ``value``: the module docstring's first case."""
    x = _poisoned(inputs.x, token, value)
    run = P.run_probe(probe, P.ProbeInputs(x, inputs.x_o, inputs.x_m, inputs.dys))
    bad = []
    for name, out in zip(("q", "k", "v"), run.outputs[:3]):
        rows = _rows(out)
        if bool(torch.isfinite(rows[token]).all()):
            bad.append(f"{name}: the poisoned token's output is finite")
        others = torch.cat([rows[:token], rows[token + 1 :]])
        if not bool(torch.isfinite(others).all()):
            bad.append(f"{name}: other tokens' outputs not finite")
    bad += _adapter_grads_reached(run, ATTN_INPUT)
    return none_of(
        f"{_label(value)} in one token's input: not reaching that token's outputs and its adapters' gradients, or "
        f"reaching others (of {len(run.adapter_grads) + 3})",
        bad,
        SOURCE,
        shown=4,
    )


def poisoned_upstream(probe: P.Probe, inputs: P.ProbeInputs, value: float = math.nan, token: int = 0) -> Verdict:
    """q's upstream gradient at token ``token`` poisoned with ``value``: the module docstring's second case."""
    dys = (_poisoned(inputs.dys[0], token, value),) + tuple(inputs.dys[1:])
    run = P.run_probe(probe, P.ProbeInputs(inputs.x, inputs.x_o, inputs.x_m, dys))
    bad = []
    dx = _rows(run.input_grads[0]) if run.input_grads[0] is not None else None
    if dx is None:
        bad.append("dx missing")
    else:
        if bool(torch.isfinite(dx[token]).all()):
            bad.append("dx of the poisoned token finite")
        if not bool(torch.isfinite(torch.cat([dx[:token], dx[token + 1 :]])).all()):
            bad.append("dx of other tokens not finite")
    bad += _adapter_grads_reached(run, ("q_proj",))
    return none_of(
        f"{_label(value)} in one token's upstream gradient of q: not reaching q's adapter gradients and that token's "
        f"input gradient, or reaching others (of {len(run.adapter_grads) + 1})",
        bad,
        SOURCE,
        shown=4,
    )


def sites(probe: P.Probe) -> list[str]:
    """Where ``poisoned_anywhere`` may put its poison: the three inputs, every output's upstream gradient
    (``dy:<output>``), every adapter tensor (``adapter:<canonical name>``)."""
    return list(P.INPUTS) + [f"dy:{o}" for o in P.OUTPUTS] + [f"adapter:{n}" for n in probe.adapters]


def linear_site(site: str) -> bool:
    """Whether every path from ``site`` to every tensor is linear (no SiLU): where ±Inf propagates by formula alone."""
    mlp = site in ("x_m", "dy:mlp") or any(f".{leaf}." in site for leaf in P.MLP)
    return not mlp


def _poison(probe: P.Probe, inputs: P.ProbeInputs, site: str, index: int, value: float) -> P.ProbeInputs:
    """``inputs`` with element ``index`` (mod its size) of ``site`` set to ``value``; an adapter site is written in
    place into the probe's adapter (as a user's ``load_state_dict`` writes it)."""

    def spoil(t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone(memory_format=torch.contiguous_format)
        out.view(-1)[index % out.numel()] = value
        return out

    if site.startswith("adapter:"):
        p = probe.adapters[site.split(":", 1)[1]]
        with torch.no_grad():
            p.view(-1)[index % p.numel()] = value
        return inputs
    if site.startswith("dy:"):
        k = P.OUTPUTS.index(site.split(":", 1)[1])
        return P.ProbeInputs(
            inputs.x, inputs.x_o, inputs.x_m, inputs.dys[:k] + (spoil(inputs.dys[k]),) + inputs.dys[k + 1 :]
        )
    xs = {"x": inputs.x, "x_o": inputs.x_o, "x_m": inputs.x_m}
    xs[site] = spoil(xs[site])
    return P.ProbeInputs(xs["x"], xs["x_o"], xs["x_m"], inputs.dys)


def mask_mismatches(got: P.ProbeRun, ref: P.ProbeRun) -> list[str]:
    """Per tensor, the elements whose finiteness differs from the float64 reference's (counted both ways), and the
    tensors one side has and the other lacks."""
    bad = []
    want = ref.tensors()
    for name, g in got.tensors().items():
        r = want.get(name)
        if r is None:
            continue
        if g is None:
            bad.append(f"{name} missing")
            continue
        fin_g, fin_r = torch.isfinite(g.reshape(r.shape)).cpu(), torch.isfinite(r).cpu()
        cleaned, spread = int((fin_g & ~fin_r).sum()), int((~fin_g & fin_r).sum())
        if cleaned or spread:
            bad.append(
                f"{name}: {cleaned} element(s) finite where float64 is not, {spread} non-finite where it is finite "
                f"(of {r.numel()})"
            )
    return bad


def poisoned_anywhere(probe: P.Probe, inputs: P.ProbeInputs, site: str, index: int, value: float = math.nan) -> Verdict:
    """One element of ``site`` (``sites``) poisoned with ``value``: every tensor's non-finite elements those of the
    float64 function of the same tensors (the module docstring's last case). ±Inf only at a ``linear_site``."""
    if site not in sites(probe):
        raise ValueError(f"poisoned_anywhere: site {site!r} is not one of {sites(probe)}")
    if not math.isnan(value) and not linear_site(site):
        raise ValueError(
            f"poisoned_anywhere: {_label(value)} at {site!r}, a site behind the SiLU: only NaN is judged there"
        )
    poisoned = _poison(probe, inputs, site, index, value)
    got = P.run_probe(probe, poisoned)
    ref = PJ.reference(probe, poisoned)
    bad = mask_mismatches(got, ref)
    return none_of(
        f"{_label(value)} in one element of {site}: tensors whose non-finite elements are not the float64 "
        f"function's (of {len(got.tensors())})",
        bad,
        SOURCE,
        shown=4,
    )


def _label(value: float) -> str:
    return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
