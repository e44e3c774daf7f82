"""A probe run (``lora_suite.engine.probes``) judged tensor by tensor against float64 from the same tensors.

The reference (``reference``) is the probe block's function by autograd in float64, none of the code under test:

    q, k, v = p(x) for p in q_proj, k_proj, v_proj      each p(x) = x Wₚᵀ + bₚ + s·(x Âₚᵀ) B̂ₚᵀ
    o       = o_proj(x_o)
    m       = down(silu(gate(x_m)) ⊙ up(x_m))

on the same tensors: the base weights as they were before injection (or, for a 4-bit base, as the implementation
itself multiplies with them: ``probes.effective_weight``), b where the shape has biases, and Â, B̂ each adapter
rounded to the activation dtype first (the cast every implementation makes or is allowed to make; see
``lora_suite.judges.parity.reference_f64``). Tolerances are ``parity.tolerance`` for one LoRA linear and
``MLP_STAGES`` of it for the MLP (its derivation: ``parity.MLP_STAGES``); each tensor's error is normalised by
max(max|ref|, its cancellation floor) (``floors``, from the absolute reference). ``dtype_errors`` names the
outputs and gradients not in the dtype F.linear and autograd give.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from lora_suite.engine.probes import INPUTS, MLP, OUTPUTS, Probe, ProbeInputs, ProbeRun
from lora_suite.judges.parity import MLP_STAGES, TensorError, cancellation_floor, compare, tolerance


def _adapter_pairs(probe: Probe, act: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each adapted layer's (Â, B̂): its adapters rounded to the activation dtype ``act``, in float64, leaves of
    autograd."""
    out = {}
    for path in probe.weights:
        a, b = probe.adapters.get(f"{path}.lora_A"), probe.adapters.get(f"{path}.lora_B")
        if a is None:
            continue
        if b is None:
            raise ValueError(f"the probe's adapters have {path}.lora_A and no {path}.lora_B: expected both or neither")
        out[path] = (a.detach().to(act).double().requires_grad_(), b.detach().to(act).double().requires_grad_())
    return out


def reference(
    probe: Probe, inputs: ProbeInputs, *, inputs_require_grad: bool = True, backward: bool = True
) -> ProbeRun:
    """The probe's function in float64 by autograd on the same tensors (none of the code under test):
    each projection ``x Wᵀ + b + s·(x Âᵀ) B̂ᵀ`` (s its own where the spec overrides its r or alpha) with Â, B̂ the adapters rounded to the activation dtype (b where the
    shape has biases)."""
    act = inputs.x.dtype
    w = {path: t.double() for path, t in probe.weights.items()}
    bias = {path: t.double() for path, t in probe.biases.items()}
    leaves = {path.rsplit(".", 1)[-1]: path for path in w}
    ad = _adapter_pairs(probe, act)
    xs = [t.detach().double().requires_grad_(inputs_require_grad) for t in (inputs.x, inputs.x_o, inputs.x_m)]

    def lin(leaf, x):
        path = leaves[leaf]
        y = x @ w[path].T
        if path in bias:
            y = y + bias[path]
        if path in ad:
            a, b = ad[path]
            y = y + probe.scale_at(path) * ((x @ a.T) @ b.T)
        return y

    x, x_o, x_m = xs
    outs = (
        lin("q_proj", x),
        lin("k_proj", x),
        lin("v_proj", x),
        lin("o_proj", x_o),
        lin("down_proj", F.silu(lin("gate_proj", x_m)) * lin("up_proj", x_m)),
    )
    if backward:
        torch.autograd.backward(outs, [d.double() for d in inputs.dys])
    grads = {}
    for path, (a_leaf, b_leaf) in ad.items():
        grads[f"{path}.lora_A"], grads[f"{path}.lora_B"] = a_leaf.grad, b_leaf.grad
    return ProbeRun(tuple(o.detach() for o in outs), tuple(t.grad if inputs_require_grad else None for t in xs), grads)


def _inner(probe: Probe, inputs: ProbeInputs) -> int:
    s = probe.shape
    return max(s.hidden, s.q_out, s.intermediate, inputs.x.numel() // s.hidden)


def tolerances(probe: Probe, inputs: ProbeInputs) -> dict[str, float]:
    """Each tensor's bound: one LoRA linear's for the projections and their inputs, ``MLP_STAGES`` of it for
    everything the MLP's chain computes (its output, dx_m, its adapters' gradients)."""
    one = tolerance(inputs.x.dtype, _inner(probe, inputs))
    out = {}
    for name in probe.run_names():
        mlp = name in ("mlp", "dx_m") or any(f".{leaf}." in name for leaf in MLP)
        out[name] = MLP_STAGES * one if mlp else one
    return out


def absolute_reference(probe: Probe, inputs: ProbeInputs) -> ProbeRun:
    """``reference`` with every input, weight, bias, adapter and upstream gradient replaced by its absolute value: each
    tensor's terms summed without cancellation (the scale ``parity.cancellation_floor`` reads)."""
    a = dataclasses.replace(
        probe,
        weights={p: t.abs() for p, t in probe.weights.items()},
        biases={p: t.abs() for p, t in probe.biases.items()},
        adapters={n: nn.Parameter(t.detach().abs(), requires_grad=False) for n, t in probe.adapters.items()},
    )
    i = ProbeInputs(inputs.x.abs(), inputs.x_o.abs(), inputs.x_m.abs(), tuple(d.abs() for d in inputs.dys))
    return reference(a, i, inputs_require_grad=inputs.x.requires_grad or True)


def floors(probe: Probe, inputs: ProbeInputs) -> dict[str, float]:
    """Each tensor's normaliser floor (``parity.cancellation_floor``) for the probe's longest inner dimension."""
    k = _inner(probe, inputs)
    return {
        n: cancellation_floor(t, k) for n, t in absolute_reference(probe, inputs).tensors().items() if t is not None
    }


def judge(probe: Probe, inputs: ProbeInputs, got: ProbeRun, ref: ProbeRun) -> list[TensorError]:
    """One ``TensorError`` per tensor the reference has (a tensor the implementation did not give is NaN:
    beyond any tolerance), normalised by max(max|ref|, the cancellation floor). The floor only lifts the normaliser,
    so a tensor within tolerance without it is within it with it: the absolute reference (a second float64 run) is
    computed only when some tensor is beyond tolerance of max|ref| alone."""
    tols = tolerances(probe, inputs)
    want = {name: r for name, r in ref.tensors().items() if r is not None}
    have = got.tensors()
    errs = {name: compare(name, have.get(name), r, tols[name]) for name, r in want.items()}
    if all(e.ok for e in errs.values()):
        return list(errs.values())
    low = floors(probe, inputs)
    return [e if e.ok else compare(n, have.get(n), want[n], tols[n], low.get(n, 0.0)) for n, e in errs.items()]


def dtype_errors(probe: Probe, inputs: ProbeInputs, got: ProbeRun) -> list[str]:
    """Outputs and gradients whose dtype is not the one F.linear and autograd give: each output in the
    activation dtype, each input gradient in its input's dtype, each adapter gradient in its adapter's dtype."""
    bad = [
        f"{n}: {o.dtype} (expected {inputs.x.dtype})" for n, o in zip(OUTPUTS, got.outputs) if o.dtype != inputs.x.dtype
    ]
    for n, g in zip(INPUTS, got.input_grads):
        if g is not None and g.dtype != inputs.x.dtype:
            bad.append(f"d{n}: {g.dtype} (expected {inputs.x.dtype})")
    for n, g in got.adapter_grads.items():
        if g is not None and g.dtype != probe.adapters[n].dtype:
            bad.append(f"d[{n}]: {g.dtype} (expected {probe.adapters[n].dtype})")
    return bad
