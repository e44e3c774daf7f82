"""Adapters that leave the project: PEFT's folder format (save / load) and merging into the base weights.

PEFT's format, as ``PeftModel.save_pretrained`` writes it for LoRA and ``PeftModel.from_pretrained`` reads it:
    adapter_model.safetensors   base_model.model.<module path>.lora_A.weight  (r, in)
                                base_model.model.<module path>.lora_B.weight  (out, r)
    adapter_config.json         {"peft_type": "LORA", "r", "lora_alpha", "target_modules", "use_rslora",
                                 "rank_pattern", "alpha_pattern", ...}
The scale is lora_alpha / r (or / √r with use_rslora), as in ``LoRALinear``. Layers whose r or alpha differ
from the most common one are listed in rank_pattern / alpha_pattern by module path.

Expert parameters (``lora_core.experts``, PEFT's ``target_parameters``) are stored as PEFT's ``ParamWrapper`` stores
them: one wrapper per parameter around the experts module, the first parameter of the module's own order innermost,
so the k-th of n adapted parameters is at ``<experts path>`` + ``.base_layer`` × (n-1-k), with
    lora_A.weight (E·r, d₂)   row e·r + j = Aₑ[j]         lora_B.weight (d₁, r·E)   column j·E + e = Bₑ[:, j]
and the config lists the parameters' leaf names in ``target_parameters``.

Merging: W' = W + s·B·A for each adapted layer, computed in fp32 (fp64 for an fp64 base) and rounded once
to W's dtype; the layer becomes a plain ``nn.Linear`` (an NF4 base is dequantised first and, if asked, quantised
again), an experts module the one ``LoRAExperts`` took the place of.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lora_core.experts import ExpertFactors, LoRAExperts, expert_factors, expert_modules
from lora_core.inject import lora_modules, replace_module
from lora_core.layer import LoRALinear, NF4Linear
from lora_core.nf4 import dequantize_nf4

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."


def _peft_key(module_path: str, which: str) -> str:
    return f"{PREFIX}{module_path}.{which}.weight"


def _expert_tensors(path: str, m: LoRAExperts) -> dict[str, tuple[str, torch.Tensor, nn.Parameter]]:
    """PEFT key of each expert factor -> (parameter, the factor in PEFT's layout, the factor as lora_core holds it)."""
    out = {}
    factors = m.factors()
    names = list(factors)
    for k, name in enumerate(names):
        f = factors[name]
        wrapper = path + ".base_layer" * (len(names) - 1 - k)
        a, b = f.lora_A.detach(), f.lora_B.detach()
        e, d1, r = b.shape
        out[_peft_key(wrapper, "lora_A")] = (name, a.reshape(e * r, a.shape[2]), f.lora_A)
        out[_peft_key(wrapper, "lora_B")] = (name, b.permute(1, 2, 0).reshape(d1, r * e), f.lora_B)
    return out


def _from_peft_layout(saved: torch.Tensor, param: torch.Tensor, is_a: bool) -> torch.Tensor:
    """A factor in PEFT's layout back to lora_core's: A (E·r, d₂) -> (E, r, d₂), B (d₁, r·E) -> (E, d₁, r)."""
    e, rows, cols = param.shape
    return saved.reshape(e, rows, cols) if is_a else saved.reshape(rows, cols, e).permute(2, 0, 1)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for a sharded DTensor (FSDP2's parameters) the whole tensor, gathered from every rank.

    Gathering is a collective: on a sharded model every rank must make the same calls in the same order.
    """
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def save_peft_adapter(
    model: nn.Module, path: str | Path, *, base_model_name_or_path: str | None = None, write: bool = True
) -> Path:
    """Write ``model``'s LoRA adapters as a PEFT folder (``peft.PeftModel.from_pretrained`` loads it).

    A model sharded with FSDP2 (``fully_shard``: DTensor adapters) is saved whole: each adapter is gathered
    from the ranks (``full_tensor``), so every rank must call this; pass ``write=(rank == 0)`` so that one
    rank writes the folder.
    """
    layers, experts = lora_modules(model), expert_modules(model)
    if not layers and not experts:
        raise ValueError("the model has no LoRA adapters to save (inject_lora first)")
    factors = expert_factors(model)
    rslora = {m.use_rslora for m in [*layers.values(), *factors.values()]}
    if len(rslora) != 1:
        raise ValueError("PEFT's format has one use_rslora per adapter; the layers mix rsLoRA and LoRA")
    every: dict[str, LoRALinear | ExpertFactors] = {**layers, **factors}
    r = Counter(m.r for m in every.values()).most_common(1)[0][0]
    alpha = Counter(m.alpha for m in every.values()).most_common(1)[0][0]
    odd = [n for n, f in factors.items() if (f.r, f.alpha) != (r, alpha)]
    if odd:
        raise ValueError(
            f"expert parameters {odd[:3]} have their own r or alpha: PEFT's format gives them the common one"
        )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": alpha,
        "use_rslora": rslora.pop(),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name in layers}),
        "target_parameters": sorted({n for m in experts.values() for n in m.adapters}) or None,
        "rank_pattern": {name: m.r for name, m in layers.items() if m.r != r},
        "alpha_pattern": {name: m.alpha for name, m in layers.items() if m.alpha != alpha},
    }
    tensors = {}
    for name, m in layers.items():
        tensors[_peft_key(name, "lora_A")] = full_tensor(m.lora_A.detach()).to("cpu").contiguous()
        tensors[_peft_key(name, "lora_B")] = full_tensor(m.lora_B.detach()).to("cpu").contiguous()
    for p, lora in experts.items():
        tensors.update({k: t.to("cpu").contiguous() for k, (_, t, _) in _expert_tensors(p, lora).items()})
    path = Path(path)
    if not write:
        return path
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return path


def _read_folder(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of a PEFT LoRA folder, each failure naming the file and what is wrong."""
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).exists():
            raise FileNotFoundError(f"{path} is not a PEFT adapter folder: {name} is missing")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path / CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path / CONFIG_FILE} holds a JSON {type(config).__name__}, expected a PEFT config object")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path / CONFIG_FILE}: peft_type {config.get('peft_type')!r}, expected 'LORA'")
    try:
        saved = load_file(str(path / WEIGHTS_FILE))
    except Exception as exc:  # noqa: BLE001  (safetensors raises its own error type, naming no file)
        raise ValueError(f"{path / WEIGHTS_FILE} is not a readable safetensors file ({exc})") from None
    # PEFT writes keys without the adapter name; tolerate ".default" from files saved with it.
    return config, {
        k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v for k, v in saved.items()
    }


def load_peft_adapter(model: nn.Module, path: str | Path) -> list[str]:
    """Copy the adapters of a PEFT LoRA folder into ``model``'s ``LoRALinear`` and ``LoRAExperts`` layers; return
    their paths.

    Refuses, naming them: keys that fit no layer, layers the folder has no weights for, shapes that differ,
    and an r or alpha (after rank_pattern / alpha_pattern) that differs from the layer's.
    """
    path = Path(path)
    config, saved = _read_folder(path)
    layers, experts = lora_modules(model), expert_modules(model)
    wanted: dict[str, torch.Tensor] = {
        _peft_key(n, w): getattr(m, w) for n, m in layers.items() for w in ("lora_A", "lora_B")
    }
    shapes = {}
    for p, m in experts.items():
        for key, (_, peft_form, factor) in _expert_tensors(p, m).items():
            wanted[key] = factor
            shapes[key] = peft_form.shape
    unexpected = sorted(set(saved) - set(wanted))
    missing = sorted(set(wanted) - set(saved))
    if unexpected or missing:
        raise ValueError(
            f"{path / WEIGHTS_FILE} does not fit the model: keys that fit no layer {unexpected[:5]}, "
            f"layers without weights {missing[:5]} ({len(unexpected)} / {len(missing)} in all)"
        )
    every: dict[str, LoRALinear | ExpertFactors] = {**layers, **expert_factors(model)}
    for name, f in every.items():
        r = config.get("rank_pattern", {}).get(name, config["r"])
        alpha = config.get("alpha_pattern", {}).get(name, config["lora_alpha"])
        if (r, float(alpha), bool(config.get("use_rslora", False))) != (f.r, float(f.alpha), f.use_rslora):
            raise ValueError(
                f"{path}: layer {name} has r={r}, alpha={alpha}, rslora={config.get('use_rslora')} in the "
                f"folder but r={f.r}, alpha={f.alpha}, rslora={f.use_rslora} in the model"
            )
    with torch.no_grad():
        for key, param in wanted.items():
            want = shapes.get(key, param.shape)
            if saved[key].shape != want:
                raise ValueError(f"{path}: {key} has shape {tuple(saved[key].shape)}, the layer's is {tuple(want)}")
            param.copy_(_from_peft_layout(saved[key], param, ".lora_A." in key) if key in shapes else saved[key])
    return list(layers) + list(experts)


def merge_lora(model: nn.Module, *, nf4: str = "16bit") -> nn.Module:
    """Fold every adapter into its base weight, in place: W' = W + s·B·A (fp32, or fp64 for an fp64 base; rounded
    once to W's dtype).

    Each ``LoRALinear`` becomes an ``nn.Linear`` in its base dtype, each ``LoRAExperts`` the experts module it took
    the place of; with an NF4 base, ``nf4="16bit"`` returns
    the merged weight in the dtype NF4 was made from, ``nf4="nf4"`` quantises it again (an ``NF4Linear``).
    """
    if nf4 not in ("16bit", "nf4"):
        raise ValueError(f"nf4={nf4!r}, expected '16bit' or 'nf4'")
    for name, m in list(lora_modules(model).items()):
        if m.quantize == "nf4":
            q = m.nf4_base()
            base = dequantize_nf4(q, q.dtype)  # (O, K)
        else:
            base = m.dense_weight().detach()
        wide = torch.promote_types(base.dtype, torch.float32)
        delta = m.scale * (m.lora_B.detach().to(wide) @ m.lora_A.detach().to(wide))  # (O, K) fp32 (fp64 base: fp64)
        merged = (base.to(wide) + delta.to(base.device)).to(base.dtype)
        linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=base.device, dtype=base.dtype)
        with torch.no_grad():
            linear.weight.copy_(merged)
            if m.bias is not None:
                linear.bias.copy_(m.bias)
        linear.requires_grad_(False)
        new = NF4Linear(linear, backend=m.backend) if (m.quantize == "nf4" and nf4 == "nf4") else linear
        replace_module(model, name, new)
    for name, lora in expert_modules(model).items():  # W'ₑ = Wₑ + s·Bₑ·Aₑ, the original module back
        replace_module(model, name, lora.merged())
    return model


__all__ = ["load_peft_adapter", "merge_lora", "save_peft_adapter"]
