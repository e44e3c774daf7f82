"""The float64 function of an adapted model, given its base and its factors: the reference every architecture check
compares a stack with (``model_function.reference_run``), in the test's process or in a fresh one
(``separate_reference``), by the same code.

For each adapted linear at ``path`` and each adapted expert parameter, the weights are replaced for one call
(``torch.func.functional_call``):

    W' = W + s·B̂·Â,          W'ₑ = Wₑ + sₑ·B̂ₑ·Âₑ (every expert at once, (E, d₁, d₂))

Â, B̂ the stack's factors rounded to the activation dtype (what it multiplies with), then widened to float64. The
gradients of L = Σ logits ⊙ G reach the factors through W': dA = s·Bᵀ·dW', dB = s·dW'·Aᵀ (per expert, batched).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.func import functional_call

from lora_suite.engine.architectures import Architecture
from lora_suite.implementations import AdapterSpec, ExpertAdapter, adapted_modules
from lora_suite.judges import stack_reference


class ArchCase(Protocol):
    """What the reference reads of a case (``model_function.ArchCase``, which this module does not import)."""

    arch: Architecture
    reference: nn.Module
    adapters: dict[str, nn.Parameter]
    experts: dict[str, ExpertAdapter]
    spec: AdapterSpec
    scale: float
    ids: torch.Tensor
    dlogits: torch.Tensor

    @property
    def dtype(self) -> torch.dtype: ...


@dataclass
class FunctionRun:
    logits: torch.Tensor
    grads: dict[str, torch.Tensor | None]  # canonical adapter name -> gradient (None: the adapter got none)


def expert_scale(case: ArchCase, name: str) -> float:
    """The spec's scale of the expert parameter ``name`` (its leaf name's rank and alpha)."""
    return case.spec.scale_of(name.rsplit(".", 1)[-1])


def reference_factors(case: ArchCase) -> tuple[dict, dict]:
    """({path: (Â, B̂)} of the linears, {parameter: (Â (E, r, d₂), B̂ (E, d₁, r), s)} of the experts) in float64, each
    rounded first to the activation dtype (what the stack multiplies with)."""
    act = case.dtype
    factors = {
        path: tuple(case.adapters[f"{path}.lora_{w}"].detach().to(act).double() for w in "AB")
        for path in adapted_modules(case.adapters)
    }
    experts = {
        name: (*(t.to(act).double() for t in ex.factors()), expert_scale(case, name))
        for name, ex in case.experts.items()
    }
    return factors, experts


def reference_math(reference, factors, experts, s, ids, dlogits, backward=True, names=None) -> FunctionRun:
    """The logits of float64 ``reference`` with W' = W + s·B̂·Â at each path of ``factors`` and W'ₑ = Wₑ + sₑ·Bₑ·Aₑ
    at each expert parameter of ``experts`` (``reference_factors``), and the factors' gradients of Σ logits ⊙ G."""
    merged = {}
    for path, (a, b) in factors.items():
        w = reference.get_submodule(path).weight
        assert isinstance(w, torch.Tensor), f"{path}: an adapted module's weight is a parameter"
        merged[f"{path}.weight"] = (w + s * b @ a).requires_grad_(backward)
    for name, (a3, b3, se) in experts.items():  # every expert at once (E, d₁, d₂)
        merged[name] = (reference.get_parameter(name) + se * b3 @ a3).requires_grad_(backward)
    with torch.set_grad_enabled(backward), stack_reference.as_built(names):
        logits = functional_call(reference, merged, (ids,)).logits
    grads: dict[str, torch.Tensor | None] = {}
    if backward:
        (logits * dlogits.double()).sum().backward()
        for path, (a, b) in factors.items():
            dw = merged[f"{path}.weight"].grad
            assert dw is not None, f"{path}: the merged weight requires a gradient"
            grads[f"{path}.lora_A"], grads[f"{path}.lora_B"] = s * b.T @ dw, s * dw @ a.T
        for name, (a, b, se) in experts.items():  # batched over experts: dAₑ = s·Bₑᵀ·dWₑ, dBₑ = s·dWₑ·Aₑᵀ
            dw = merged[name].grad
            assert dw is not None, f"{name}: the merged expert weights require a gradient"
            grads[f"{name}.lora_A"], grads[f"{name}.lora_B"] = se * b.mT @ dw, se * dw @ a.mT
    return FunctionRun(logits.detach(), grads)
