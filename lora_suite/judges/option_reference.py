"""The float64 function of a model adapted with PEFT's options (``option_cases``), from the base as built and the
stack's own adapter and option tensors (canonical names, ``lora_suite.implementations.peft_names``).

Each tensor the stack trains becomes a float64 leaf; the base's parameters are replaced where the adapters act
(``torch.func.functional_call`` on the float64 copy, ties not followed, so an adapted embedding leaves a tied LM head
on E), and autograd gives the reference gradient of every leaf for L = Σ logits ⊙ G:

- a linear at ``path``:      W' = W + s·B·A;      with ``lora_bias``, b' = b + s·b_B        (PEFT's lora_B has the bias)
- an embedding at ``path``:  E' = E + s·(B·A)ᵀ,  A (r, vocab), B (hidden, r)                (PEFT's Embedding layer)
- DoRA at ``path``:          W' = (m / ‖V‖)[:, None] · V,  V = W + s·B·A,  ‖V‖ the norm of each output row taken as a
  constant in the backward (DoRA, Liu et al. 2024, §4.3; PEFT detaches it the same way)
- a saved module at ``path``: its parameters the copy's                                      (PEFT's modules_to_save)

``s`` is the spec's scale of the module's leaf name (alpha/r with its overrides). ``base`` may give a base weight
other than the one built: PiSSA and OLoRA replace W by a residual at init, which ``adapter_options`` judges on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import functional_call

from lora_suite.implementations.peft_names import SAVED, owner
from lora_suite.judges.option_cases import OptionCase


@dataclass
class Reference:
    logits: torch.Tensor
    grads: dict[str, torch.Tensor]  # canonical name -> float64 gradient


def leaves(case: OptionCase, backward: bool) -> dict[str, torch.Tensor]:
    return {n: p.detach().double().requires_grad_(backward) for n, p in case.held.items()}


def adapted_weights(case: OptionCase, t: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> dict:
    """{parameter name of the float64 copy: its adapted value} from the leaves ``t``."""
    out: dict[str, torch.Tensor] = {}
    for name, value in t.items():
        if SAVED in name:
            path, rest = name.split(SAVED, 1)
            out[f"{path}.{rest}"] = value
    for path in dict.fromkeys(owner(n) for n in t if SAVED not in n):
        s = case.spec.scale_of(path.rsplit(".", 1)[-1])
        w = base.get(f"{path}.weight", _param(case, f"{path}.weight"))
        if f"{path}.lora_embedding_A" in t:
            out[f"{path}.weight"] = w + s * (t[f"{path}.lora_embedding_B"] @ t[f"{path}.lora_embedding_A"]).T
            continue
        if f"{path}.lora_A" not in t:
            continue
        v = w + s * t[f"{path}.lora_B"] @ t[f"{path}.lora_A"]
        if f"{path}.lora_magnitude" in t:
            v = (t[f"{path}.lora_magnitude"] / v.detach().norm(dim=1))[:, None] * v
        out[f"{path}.weight"] = v
        if f"{path}.lora_bias" in t:
            out[f"{path}.bias"] = _param(case, f"{path}.bias") + s * t[f"{path}.lora_bias"]
    return out


def _param(case: OptionCase, name: str) -> torch.Tensor:
    """A parameter of the float64 copy of the base by name (a tied one under either name)."""
    return case.reference.get_parameter(name)


def reference(case: OptionCase, *, backward: bool = True, base: dict[str, torch.Tensor] | None = None) -> Reference:
    """The float64 logits and, with ``backward``, the gradient of every tensor the stack trains."""
    t = leaves(case, backward)
    with torch.set_grad_enabled(backward):
        weights = adapted_weights(case, t, base or {})
        logits = functional_call(case.reference, weights, (case.ids,), tie_weights=False).logits
    grads: dict[str, torch.Tensor] = {}
    if backward:
        (logits * case.dlogits.double()).sum().backward()
        grads = {n: v.grad if v.grad is not None else torch.zeros_like(v) for n, v in t.items()}
    return Reference(logits.detach(), grads)


def base_logits(case: OptionCase) -> torch.Tensor:
    """The float64 base model's logits (no adapter): what a no-op init must compute."""
    with torch.no_grad():
        return case.reference(case.ids).logits
