"""The float64 reference of a stack whose model is not the one the suite built: a 4-bit base (bitsandbytes NF4, put
in by the stack's inject or its loader), read back from the stack's own layers after ``inject``.

``effective_copy`` builds the architecture again in float64 and fills every parameter from the adapted model:

- a linear whose weight is a floating tensor (the LM head, a 16-bit layer) copies it;
- a quantised linear gives the weight it multiplies with, read through its own base layer (the innermost
  ``base_layer``, so no adapter takes part) called on the identity with its bias held out for the call: each
  output element is one dequantised weight times 1, exact in the layer's compute dtype;
- every other parameter (norms, embeddings, biases) copies the stack's tensor of the same name (through the
  wrappers' ``base_layer`` where one sits in the path).

The reference then computes the un-quantised function of the dequantised base, W_q + s·B·A, so the NF4 rounding of
the base is not counted as LoRA error. That rounding is judged on its own (``nf4_verdict``): each dequantised
weight lies within NF4's rounding of the weight the suite built,

    |W_q − W| ≤ g/2 · absmax_block + 2⁻⁵ · max absmax + 2·u·|W|

with g = 0.277 the widest gap between neighbouring NF4 levels (0.7230 to 1), absmax_block the block's largest |W|
over its 64 elements, 2⁻⁵ · max absmax a bound on the double quantisation's error of a block's absmax (absmax stored
in 8 bits per block of 256, its error a fraction of the largest absmax of the tensor), and u the compute dtype's unit
roundoff: a loader that quantises the wrong tensor, transposes it or mixes blocks is far outside it (errors of the
order of |W| itself).
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from lora_core.nf4 import BLOCKSIZE, NF4_CODE
from lora_suite.engine.architectures import Architecture
from lora_suite.judges.layer_checks import none_of
from lora_suite.measure.criteria import Verdict

NF4_HALF_GAP = max(b - a for a, b in zip(NF4_CODE, NF4_CODE[1:])) / 2
ABSMAX_ERROR = 2.0**-5  # double quantisation: a block's absmax within this fraction of the tensor's largest
SOURCE = "QLoRA §2 (NF4, block 64, double quantisation); stack_reference.py"


@dataclass(frozen=True)
class ModelingNames:
    """The names of a transformers modeling module (``modeling_llama``: its functions and classes) as they were
    when the suite built a model, before any stack was injected."""

    module: types.ModuleType
    names: dict[str, object]

    @classmethod
    def of(cls, model: nn.Module) -> ModelingNames:
        module = sys.modules[type(model).__module__]
        return cls(module, dict(vars(module)))


@contextmanager
def as_built(names: ModelingNames | None):
    """For the block, every name of the modeling module that a stack replaced (Liger's ``apply_rotary_pos_emb``,
    its RMSNorm and MLP classes: patches that hold for the whole process) put back to what it was when the model was
    built, then the stack's put back again: the float64 reference runs transformers' own code, whatever the stack
    under test patched."""
    if names is None:
        yield
        return
    changed = {k: v for k, v in vars(names.module).items() if k in names.names and names.names[k] is not v}
    for k in changed:
        setattr(names.module, k, names.names[k])
    try:
        yield
    finally:
        for k, v in changed.items():
            setattr(names.module, k, v)


def _innermost(m: nn.Module) -> nn.Module:
    while isinstance(inner := getattr(m, "base_layer", None), nn.Module):
        m = inner
    return m


@contextmanager
def _without_bias(m: nn.Module):
    bias = getattr(m, "bias", None)
    if bias is not None:
        setattr(m, "bias", None)  # noqa: B010 (a module's parameter slot, held out for one call)
    try:
        yield
    finally:
        if bias is not None:
            setattr(m, "bias", bias)  # noqa: B010


def linear_weight(model: nn.Module, path: str, dtype: torch.dtype) -> torch.Tensor:
    """The (out, in) weight the linear at ``path`` multiplies with, in float64 (module docstring)."""
    base = _innermost(model.get_submodule(path))
    w = getattr(base, "weight", None)
    if isinstance(w, torch.Tensor) and w.is_floating_point() and w.dim() == 2:
        return w.detach().double()
    n_in = getattr(base, "in_features", None)
    if not isinstance(n_in, int):
        raise ValueError(f"{path}: {type(base).__name__} holds no floating weight and names no in_features")
    device = next(t.device for t in base.state_dict().values() if isinstance(t, torch.Tensor))
    with torch.no_grad(), _without_bias(base):
        out = base(torch.eye(n_in, dtype=dtype, device=device))
    return out.T.double()


def parameter(model: nn.Module, name: str) -> torch.Tensor:
    """The stack's tensor of the un-adapted parameter ``name`` (a wrapper's ``base_layer`` passed through)."""
    path, _, leaf = name.rpartition(".")
    m = _innermost(model.get_submodule(path)) if path else model
    t = getattr(m, leaf, None)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: the adapted model holds no tensor there ({type(m).__name__}.{leaf})")
    return t.detach()


def effective_copy(arch: Architecture, model: nn.Module, dtype: torch.dtype, *, seed: int = 0) -> nn.Module:
    """``arch`` in float64 holding the adapted ``model``'s base as its layers compute with it (``dtype``: the
    compute dtype its quantised layers take), frozen."""
    reference = arch.build(torch.float64, "cpu", seed=seed)
    device = next(model.parameters()).device
    linears = {p for p, m in reference.named_modules() if isinstance(m, nn.Linear)}
    state = {}
    for name, _ in reference.named_parameters(remove_duplicate=False):  # a tied head under both of its names
        path, _, leaf = name.rpartition(".")
        if path in linears and leaf == "weight":
            state[name] = linear_weight(model, path, dtype)
        else:
            state[name] = parameter(model, name).double()
    reference.load_state_dict(state, strict=True)
    return reference.to(device).requires_grad_(False)


def nf4_verdict(arch_name: str, built: dict[str, torch.Tensor], reference: nn.Module, dtype: torch.dtype) -> Verdict:
    """Each dequantised weight of ``reference`` within NF4's rounding of the weight the suite ``built`` (module
    docstring); weights that were not quantised must be bitwise the built ones (after the cast to float64)."""
    u = torch.finfo(dtype).eps / 2
    bad, judged = [], 0
    for name, w in built.items():
        if not name.endswith(".weight") or w.dim() != 2:
            continue
        q = reference.get_parameter(name).detach().to(w.device)
        judged += 1
        w64 = w.double()
        if torch.equal(q, w64):
            continue
        flat, got = w64.flatten(), q.flatten()
        if flat.numel() % BLOCKSIZE:
            bad.append(f"{name}: differs from the built weight and is no whole number of {BLOCKSIZE}-blocks")
            continue
        absmax = flat.view(-1, BLOCKSIZE).abs().amax(1, keepdim=True).expand(-1, BLOCKSIZE).flatten()
        bound = NF4_HALF_GAP * absmax + ABSMAX_ERROR * absmax.max() + 2 * u * flat.abs()
        over = (got - flat).abs() > bound
        if over.any():
            i = int(over.nonzero()[0])
            bad.append(
                f"{name}: element {i} dequantises to {float(got[i]):.5g}, built {float(flat[i]):.5g} "
                f"(NF4 bound {float(bound[i]):.3g})"
            )
    return none_of(
        f"{arch_name}: base weights beyond NF4's rounding of the built ones (of {judged})", bad, SOURCE, shown=3
    )
