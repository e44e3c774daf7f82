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
  input gradient stays finite.
"""

from __future__ import annotations

import math

import torch

from lora_suite.engine import probes as P
from lora_suite.engine.layer_checks import none_of
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


def _label(value: float) -> str:
    return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
