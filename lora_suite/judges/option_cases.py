"""The options of PEFT's ``LoraConfig`` that change what a LoRA model is, each as one case for any implementation: the
architecture it is judged on, the settings it adds to the spec, and the feature a stack declares for it
(``contract.FEATURES``; a stack that lacks it is not applicable with its own reason).

| case | settings | what must hold (``adapter_options``) |
|---|---|---|
| lora_bias | bias on B, Qwen2's biased q/k/v | b' = b + s·b_B; dL/db_B = s·dL/db' |
| layers_to_transform | layer 1 only | adapters on exactly the targets of layer 1 |
| modules_to_save | lm_head saved | the copy trained, used and saved; the original frozen, untouched |
| embedding | embed_tokens | E' = E + s·(B·A)ᵀ; the LM head keeps E |
| embedding_tied | embed_tokens of Gemma 2 (tied, scaled) | the same, the tied head keeps E |
| lm_head | lm_head | W' = W + s·B·A on the output projection |
| init_gaussian | init 'gaussian' | A ~ N(0, (1/r)²), B = 0 |
| init_random_b | init False | B ≠ 0: the model is not its base at the start |
| init_pissa | init 'pissa' | s·B·A = the top-r SVD part of W; base W − s·B·A; the start is the base function |
| init_olora | init 'olora' | B·A = Q_r·R_r of W = Q·R; base W − s·B·A; the start is the base function |
| dora | use_dora | W' = m ⊙ V / ‖V‖ per output row, V = W + s·B·A, ‖V‖ a constant in the backward |

Every case is then judged the same way: the function and every gradient against float64, the trainable set, a step,
merge and unmerge where the stack offers them, and the round trip through its folder.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from lora_suite.engine.architectures import ARCHITECTURES, Architecture
from lora_suite.implementations import AdapterSpec, LoRAImplementation, adapted_modules
from lora_suite.implementations.contract import INITS

R, ALPHA = 4, 7.0  # s = 1.75: neither 1 nor a whole number, so a scale applied twice or not at all shows
BATCH, SEQ = 2, 12


@dataclass(frozen=True)
class Option:
    feature: str  # contract.FEATURES
    arch: str  # lora_suite.engine.architectures.ARCHITECTURES
    settings: dict  # AdapterSpec fields beside r, alpha, fp32 adapters


def _init(name: str) -> Option:
    return Option(INITS[name], "llama", {"targets": ("q_proj", "v_proj", "down_proj"), "init": name})


OPTIONS = {
    "lora_bias": Option("lora_bias", "qwen2", {"targets": ("q_proj", "k_proj", "v_proj"), "lora_bias": True}),
    "layers_to_transform": Option(
        "layers_to_transform", "llama", {"targets": ("q_proj", "v_proj", "down_proj"), "layers_to_transform": (1,)}
    ),
    "modules_to_save": Option(
        "modules_to_save", "llama", {"targets": ("q_proj", "v_proj"), "modules_to_save": ("lm_head",)}
    ),
    "embedding": Option("embedding_target", "llama", {"targets": ("embed_tokens", "q_proj")}),
    "embedding_tied": Option("embedding_target", "gemma2", {"targets": ("embed_tokens", "q_proj")}),
    "lm_head": Option("lm_head_target", "llama", {"targets": ("lm_head", "v_proj")}),
    **{f"init_{name}": _init(name) for name in INITS if name != "default"},
    "dora": Option("dora", "llama", {"targets": ("q_proj", "v_proj", "down_proj"), "use_dora": True}),
}


@dataclass
class OptionCase:
    """One option's model adapted by one implementation, and what it is compared against."""

    name: str
    option: Option
    arch: Architecture
    impl: LoRAImplementation
    spec: AdapterSpec
    model: nn.Module
    reference: nn.Module  # float64 copy of the base model as built (before inject), no gradients
    after_inject: dict[str, torch.Tensor]  # every parameter right after inject, before anything is randomised
    adapters: dict[str, nn.Parameter]
    options: dict[str, nn.Parameter]
    ids: torch.Tensor
    dlogits: torch.Tensor
    seed: int = 0

    @property
    def held(self) -> dict[str, nn.Parameter]:
        return {**self.adapters, **self.options}


def spec_of(option: Option) -> AdapterSpec:
    return AdapterSpec(**{"r": R, "alpha": ALPHA, "adapter_dtype": torch.float32, **option.settings})


def adapt(impl: LoRAImplementation, arch: Architecture, spec: AdapterSpec, device, seed: int):
    """``arch`` built in fp32 from ``seed`` and adapted by ``impl`` as a tier would (its loader, inject, finish), with
    a float64 copy of the base taken before (no gradients): (model, reference)."""
    model = arch.build(torch.float32, device, seed=seed)
    reference = copy.deepcopy(model).double().requires_grad_(False)
    torch.manual_seed(seed)
    model = impl.load_model(model, spec)
    impl.inject(model, spec)
    impl.finish_model(model, spec)
    return model, reference


def build(impl: LoRAImplementation, name: str, device, *, seed: int = 0) -> OptionCase:
    """Option ``name`` built in fp32 from ``seed``, copied in float64, adapted by ``impl`` (which refuses an option it
    lacks); random ids and an upstream gradient of the logits. Nothing is randomised yet (``randomise``)."""
    option = OPTIONS[name]
    arch, spec = ARCHITECTURES[option.arch], spec_of(option)
    impl.refuse_unsupported(spec)
    model, reference = adapt(impl, arch, spec, device, seed)
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = arch.config().vocab_size
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen).to(device)
    dlogits = torch.randn(BATCH, SEQ, vocab, generator=gen).to(device)
    adapters, options = impl.adapter_parameters(model), impl.option_parameters(model)
    return OptionCase(
        name, option, arch, impl, spec, model.train(), reference, after, adapters, options, ids, dlogits, seed
    )


def randomise(case: OptionCase) -> None:
    """Every adapter and option tensor set to random values (A std 1/√in, B std 1/√r, a bias or magnitude near its own
    scale, a saved module's copy moved off the original), so that each one shows in the function and its gradient."""
    gen = torch.Generator().manual_seed(case.seed + 2)
    with torch.no_grad():
        for n, p in case.held.items():
            noise = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
            if n.endswith(("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")):
                p.copy_(noise * p.shape[-1] ** -0.5)
            elif n.endswith(".lora_magnitude"):
                p.mul_(1 + 0.3 * noise)
            else:  # a bias on B, a saved module's parameter
                p.add_(0.3 * noise * (p.detach().abs().mean() + 0.1))


def adapted_paths(case: OptionCase) -> list[str]:
    return adapted_modules(case.adapters)


def expected_paths(case: OptionCase) -> list[str]:
    """The module paths the settings name: every linear or embedding whose leaf name is a target, in the listed
    decoder layers only where ``layers_to_transform`` is set (an LM head or embedding is in no layer)."""
    layers = set(case.spec.layers_to_transform)
    out = []
    for path, m in case.reference.named_modules():
        if not isinstance(m, (nn.Linear, nn.Embedding)) or path.rsplit(".", 1)[-1] not in case.spec.targets:
            continue
        parts = path.split(".")
        index = next(
            (int(parts[i + 1]) for i, p in enumerate(parts[:-1]) if p == "layers" and parts[i + 1].isdigit()), None
        )
        if layers and index not in layers:
            continue
        out.append(path)
    return out
