"""LoRA on a mixture-of-experts block's 3-D expert parameters: ``LoRAExperts`` takes the place of a transformers
``*Experts`` module (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3 and the others of the same form), as PEFT's
``target_parameters`` does with its ``ParamWrapper``.

The form it adapts, every expert e of E stored as F.linear takes it:

    gate_up_proj (E, 2I, H),  down_proj (E, H, I),  act_fn;   for the tokens T routed to e (top-k slot k):
    [g, u] = x_T · W_guₑᵀ,  h = act(g) ⊙ u,  y_T += w_{T,k} · (h · W_dₑᵀ)

An adapted parameter W (E, d₁, d₂) gets, per expert, the dense layer's update:

    W'ₑ = Wₑ + s·Bₑ·Aₑ,   lora_A (E, r, d₂),  lora_B (E, d₁, r),   s = alpha / r (alpha / √r with rsLoRA)

Each expert's product is ``lora_core.ops.lora_linear`` over that expert's tokens only (grouped over experts: one
CuPy/cuBLAS LoRA GEMM pair per expert reached, on the cupy backend), so an expert no token reaches takes no part in
the step and its factors get exactly zero gradient. A module of another form (transposed storage, biases, other
names, an ungated MLP) is refused, naming what differs: it would be computed wrongly, not merely slowly.

Initialisation follows PEFT's ParamWrapper: each expert's A kaiming-uniform (a = √5) over its d₂ inputs, B zero.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn

from lora_core.backend import resolve_backend, validate_backend_name
from lora_core.layer import lora_scale
from lora_core.ops.lora_linear import lora_linear
from lora_core.targets import EXPERT_PARAMETERS  # the 3-D parameters of the form above, in registration order


def expert_form_error(experts: nn.Module) -> str | None:
    """Why ``experts`` is not of the form ``LoRAExperts`` computes (None: it is)."""
    own = dict(experts.named_parameters(recurse=False))
    kind = type(experts).__name__
    if set(own) != set(EXPERT_PARAMETERS):
        return f"{kind} holds parameters {sorted(own)}, expected exactly {list(EXPERT_PARAMETERS)}"
    gu, down = own["gate_up_proj"], own["down_proj"]
    if gu.dim() != 3 or down.dim() != 3:
        return f"{kind}: gate_up_proj {tuple(gu.shape)} and down_proj {tuple(down.shape)} are not both 3-D"
    e, two_i, h = gu.shape
    if tuple(down.shape) != (e, h, two_i // 2) or two_i % 2:
        return (
            f"{kind}: gate_up_proj {tuple(gu.shape)} and down_proj {tuple(down.shape)} are not stored (E, 2I, H) and "
            f"(E, H, I) (a transposed layout is another form)"
        )
    if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False):
        return f"{kind} is transposed or carries biases (is_transposed / has_bias)"
    if not callable(getattr(experts, "act_fn", None)) or getattr(experts, "num_experts", None) != e:
        return f"{kind} has no act_fn, or a num_experts other than its parameters' {e}"
    return None


class ExpertFactors(nn.Module):
    """lora_A (E, r, d₂) and lora_B (E, d₁, r) of one 3-D parameter (E, d₁, d₂), with its r, alpha and scale."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter

    def __init__(self, weight: torch.Tensor, r: int, alpha: float, use_rslora: bool, dtype: torch.dtype):
        super().__init__()
        self.r: int = r
        self.alpha: float = alpha
        self.use_rslora: bool = use_rslora
        self.scale: float = lora_scale(r, alpha, use_rslora)
        e, d1, d2 = weight.shape
        self.lora_A = nn.Parameter(torch.empty(e, r, d2, device=weight.device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(e, d1, r, device=weight.device, dtype=dtype))
        self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        for a in self.lora_A:  # each expert's (r, d₂) as nn.Linear's init: U(±1/√d₂)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def delta(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """s·Bₑ·Aₑ for every expert, (E, d₁, d₂) in ``dtype``."""
        return self.scale * torch.bmm(self.lora_B.detach().to(dtype), self.lora_A.detach().to(dtype))


class LoRAExperts(nn.Module):
    """The experts module of an MoE block with LoRA on some of its 3-D parameters (``parameters``).

    The base parameters are the module's own (shared, frozen, under their own names, so a checkpoint of the base
    model still loads); the factors are ``adapters.<parameter>.lora_A`` / ``.lora_B``. ``merged()`` folds them in and
    gives the original module back.
    """

    gate_up_proj: nn.Parameter  # registered from the original module (declared for type checkers)
    down_proj: nn.Parameter
    act_fn: nn.Module
    original: nn.Module

    def __init__(
        self,
        experts: nn.Module,
        parameters: tuple[str, ...],
        r: int = 8,
        alpha: float = 16,
        *,
        use_rslora: bool = False,
        backend: str | None = None,
        adapter_dtype: torch.dtype | None = torch.float32,
    ):
        super().__init__()
        if (why := expert_form_error(experts)) is not None:
            raise ValueError(f"LoRAExperts cannot adapt this module: {why}")
        unknown = [p for p in parameters if p not in EXPERT_PARAMETERS]
        if unknown or not parameters:
            raise ValueError(f"parameters {unknown or list(parameters)} are not among {list(EXPERT_PARAMETERS)}")
        self.__dict__["original"] = experts  # outside the module tree: merged() gives it back
        self.num_experts = int(cast(int, experts.num_experts))
        self.act_fn = cast(nn.Module, experts.act_fn)
        for name in EXPERT_PARAMETERS:
            self.register_parameter(name, getattr(experts, name))
            getattr(experts, name).requires_grad_(False)
        self.backend = validate_backend_name(backend)
        self.last_backend: str | None = None
        self.adapters = nn.ModuleDict()
        for name in EXPERT_PARAMETERS:  # registration order: PEFT's nesting of its wrappers follows it
            if name in parameters:
                w = getattr(experts, name)
                dtype = w.dtype if adapter_dtype is None or w.dtype == torch.float64 else adapter_dtype
                self.adapters[name] = ExpertFactors(w, r, alpha, use_rslora, dtype)

    def factors(self) -> dict[str, ExpertFactors]:
        """Parameter name -> its factors, in the module's registration order."""
        return {name: cast(ExpertFactors, f) for name, f in self.adapters.items()}

    def _project(self, name: str, x: torch.Tensor, e: int) -> torch.Tensor:
        """x · W'ₑᵀ for parameter ``name`` (the plain product where it is not adapted)."""
        w = getattr(self, name)[e]
        if name not in self.adapters:
            return nn.functional.linear(x, w)
        f = self.factors()[name]
        assert self.last_backend is not None, "forward resolves the backend first"
        return lora_linear(x, w, f.lora_A[e], f.lora_B[e], f.scale, backend=self.last_backend)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """(T, H) hidden states, (T, k) chosen experts and their weights -> (T, H): the module's own routing rule."""
        self.last_backend = resolve_backend(self.backend, hidden_states.device)
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            hit = torch.unique(top_k_index[(top_k_index >= 0) & (top_k_index < self.num_experts)]).tolist()
        for e in hit:
            token, slot = torch.where(top_k_index == e)
            gate, up = self._project("gate_up_proj", hidden_states[token], e).chunk(2, dim=-1)
            y = self._project("down_proj", self.act_fn(gate) * up, e)
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out

    @torch.no_grad()
    def merged(self) -> nn.Module:
        """The original module with W'ₑ = Wₑ + s·Bₑ·Aₑ folded into each adapted parameter (in fp32, or W's dtype where
        wider, rounded once to W's dtype)."""
        for name, f in self.factors().items():
            w = getattr(self, name)
            wide = torch.promote_types(w.dtype, torch.float32)
            w.copy_((w.to(wide) + f.delta(wide).to(w.device)).to(w.dtype))
        return self.original

    def extra_repr(self) -> str:
        f = next(iter(self.factors().values()))
        return (
            f"num_experts={self.num_experts}, adapted={list(self.adapters)}, r={f.r}, alpha={f.alpha}, "
            f"rslora={f.use_rslora}, backend={self.backend or 'auto'}"
        )


def expert_modules(model: nn.Module) -> dict[str, LoRAExperts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRAExperts)}


def expert_factors(model: nn.Module) -> dict[str, ExpertFactors]:
    """``<experts path>.<parameter>`` (the parameter's name in the un-adapted model) -> its factors, in module order."""
    return {f"{path}.{name}": f for path, m in expert_modules(model).items() for name, f in m.factors().items()}


def chosen_experts(model: nn.Module, parameters: tuple[str, ...]) -> list[tuple[str, nn.Module, tuple[str, ...]]]:
    """(module path, module, its parameters selected) for every module holding a parameter that ``parameters``
    selects, a leaf name ("gate_up_proj") or a dotted suffix ("mlp.experts.down_proj") as in PEFT's
    ``target_parameters``; a ValueError names an entry that selects nothing."""
    out, used = [], set()
    for path, module in model.named_modules():
        chosen = []
        for leaf, _ in module.named_parameters(recurse=False):
            full = f"{path}.{leaf}" if path else leaf
            hits = [t for t in parameters if full == t or full.endswith("." + t)]
            used.update(hits)
            chosen += [leaf] if hits else []
        if chosen:
            out.append((path, module, tuple(chosen)))
    missing = [t for t in parameters if t not in used]
    if missing:
        raise ValueError(f"target_parameters {missing} select no parameter of {type(model).__name__}")
    return out


__all__ = [
    "EXPERT_PARAMETERS",
    "ExpertFactors",
    "LoRAExperts",
    "chosen_experts",
    "expert_factors",
    "expert_form_error",
    "expert_modules",
]
