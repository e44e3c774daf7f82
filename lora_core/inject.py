"""Put LoRA into a Hugging Face Llama-family model: replace matching ``nn.Linear`` with ``LoRALinear``.

Targets are the projection names of a Llama block (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
down_proj) or "all-linear" (every nn.Linear except the LM head, as PEFT's shorthand). Everything that is
not an adapter is frozen. A target that matches nothing is an error: a typo must not silently train
nothing. ``target_parameters`` adapts a mixture-of-experts block's 3-D expert parameters (``lora_core.experts``).
With ``quantize="nf4"`` (QLoRA) the targets get NF4 bases and every other linear except the LM
head becomes a frozen ``NF4Linear``; embeddings and the LM head stay 16-bit, as in QLoRA.
"""

from __future__ import annotations

import torch
from torch import nn

from lora_core.experts import LoRAExperts, chosen_experts, expert_modules
from lora_core.layer import LoRALinear, NF4Linear
from lora_core.targets import ALL_LINEAR, TARGET_NAMES

__all__ = ["ALL_LINEAR", "TARGET_NAMES", "inject_lora", "adapter_parameters"]


def _matches(name: str, module: nn.Module, targets: tuple[str, ...]) -> str | None:
    """The target that selects ``name``, or None."""
    if not isinstance(module, nn.Linear):
        return None
    leaf = name.rsplit(".", 1)[-1]
    if ALL_LINEAR in targets and leaf != "lm_head":
        return ALL_LINEAR
    return leaf if leaf in targets else None


def inject_lora(
    model: nn.Module,
    targets: tuple[str, ...] | list[str] | str = ("q_proj", "v_proj"),
    r: int = 8,
    alpha: float = 16,
    *,
    backend: str | None = None,
    use_rslora: bool = False,
    adapter_dtype: torch.dtype | None = torch.float32,
    quantize: str | None = None,
    fuse: tuple[str, ...] | list[str] | str = (),
    target_parameters: tuple[str, ...] | list[str] = (),
) -> list[str]:
    """Replace the target linears in place, freeze everything else; return the replaced module names.

    ``fuse`` (any of "mlp", "qkv", "o") then routes those parts through the fused paths (``lora_core.fuse``); a
    part it cannot fuse is an error naming why, never an unfused run. ``target_parameters`` (leaf names or dotted
    suffixes, as PEFT's) puts a ``LoRAExperts`` in place of each experts module holding one; the names returned are
    the linears'. Under ``quantize="nf4"`` the experts keep their dtype (bitsandbytes quantises no 3-D parameter either).
    """
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    target_parameters = tuple(target_parameters)
    _check_injectable(model, targets, bool(target_parameters))
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module, params in chosen_experts(model, target_parameters) if target_parameters else []:
        lora = LoRAExperts(
            module, params, r, alpha, use_rslora=use_rslora, backend=backend, adapter_dtype=adapter_dtype
        )
        replace_module(model, name, lora)
    chosen = _chosen_linears(model, targets) if targets else []
    for name, module, _ in chosen:
        replace_module(
            model,
            name,
            LoRALinear.from_linear(
                module,
                r=r,
                alpha=alpha,
                backend=backend,
                use_rslora=use_rslora,
                adapter_dtype=adapter_dtype,
                quantize=quantize,
            ),
        )
    _quantize_other_linears(model, quantize, backend)
    if fuse:
        from lora_core.fuse import fuse_lora

        fuse_lora(model, fuse)
    return [name for name, _, _ in chosen]


def _check_injectable(model: nn.Module, targets: tuple[str, ...], experts: bool = False) -> None:
    """A ValueError for a model that already has LoRA layers, or for targets that are unknown (or none, unless
    ``experts``: expert parameters are targeted)."""
    already = [name for name, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAExperts))]
    if already:
        raise ValueError(
            f"{type(model).__name__} already has {len(already)} LoRA layer(s) ({already[0]}, ...): inject_lora "
            "freezes everything but the adapters it adds, so a second call would freeze these; inject once per "
            "base model"
        )
    unknown = [t for t in targets if t not in TARGET_NAMES + (ALL_LINEAR,)]
    if unknown or not (targets or experts):
        raise ValueError(f"targets {unknown or list(targets)} are not among {TARGET_NAMES} or {ALL_LINEAR!r}")


def _chosen_linears(model: nn.Module, targets: tuple[str, ...]) -> list[tuple[str, nn.Linear, str]]:
    """(module path, nn.Linear, the target that selects it) in module order; a ValueError names a target that
    selects nothing, and the linears the model has."""
    chosen = [
        (name, module, hit)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and (hit := _matches(name, module, targets)) is not None
    ]
    matched = {hit for _, _, hit in chosen}
    missing = [t for t in targets if t not in matched]
    if missing:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"LoRA target(s) {missing} match no nn.Linear in {type(model).__name__}; "
            f"its linear layers are named {linears}"
        )
    return chosen


def _quantize_other_linears(model: nn.Module, quantize: str | None, backend: str | None) -> None:
    """With quantize="nf4", every linear that is not a target (nor the LM head) becomes a frozen NF4Linear."""
    if quantize == "nf4":
        others = [
            (n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] != "lm_head"
        ]
        for name, module in others:
            replace_module(model, name, NF4Linear(module, backend=backend))
    elif quantize is not None:
        raise ValueError(f"quantize={quantize!r} is not None or 'nf4'")


def target_linears(model: nn.Module, targets: tuple[str, ...]) -> list[tuple[str, nn.Linear]]:
    """(module path, nn.Linear) of every linear ``targets`` select, in module order; none is not an error here
    (``inject_lora`` names missing targets). Shared with the harness's peer implementations: one meaning of a
    target everywhere."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and _matches(name, module, targets) is not None
    ]


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` at module path ``name`` of ``model``."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def adapter_parameters(model: nn.Module, *, experts: bool = True) -> dict[str, nn.Parameter]:
    """Name -> parameter of every adapter (lora_A / lora_B), in module order: the linears', then (``experts``) each
    ``LoRAExperts``'s factors by their own names (``<path>.adapters.<parameter>.lora_A``)."""
    out = {f"{name}.{p}": getattr(m, p) for name, m in lora_modules(model).items() for p in ("lora_A", "lora_B")}
    for path, m in expert_modules(model).items() if experts else []:
        out.update(
            {f"{path}.adapters.{n}.{w}": getattr(f, w) for n, f in m.factors().items() for w in ("lora_A", "lora_B")}
        )
    return out
