"""A tier's model, adapters and data from its config: the part every tier shares before training.

``prepare(cfg, device)`` builds the base model (``models.build_model``, honouring the weights mode),
injects LoRA into the configured targets with the implementation under test (``cfg.implementation`` or the
one given), and returns it with its adapters, the batch source and what was built, in words, for the
report. The torch dtype names of the YAML are resolved here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lora_suite.engine.data import Batches, tokenizer_for
from lora_suite.engine.models import BuiltModel, build_model
from lora_suite.implementations import (
    AdapterSpec,
    ExpertAdapter,
    ImplementationError,
    LoRAImplementation,
    adapted_modules,
    resolve_implementation,
)
from lora_suite.settings.config import TierConfig

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Prepared:
    built: BuiltModel
    model: nn.Module
    batches: Batches
    replaced: list[str]  # module names that received adapters
    quantize: str | None  # the base storage actually used (None: 16-bit)
    implementation: LoRAImplementation
    # canonical name (<module path>.lora_A / .lora_B) -> parameter: every tensor training updates, the expert
    # adapters' too (<expert parameter>.lora_A / .lora_B, in the stack's own layout)
    adapters: dict[str, nn.Parameter]
    spec: AdapterSpec | None = None  # what inject was asked for (None only for a Prepared built by hand)
    experts: dict[str, ExpertAdapter] = dataclasses.field(default_factory=dict)  # the 3-D expert parameters adapted

    def canonical(self) -> dict[str, torch.Tensor]:
        """``adapters`` with each expert factor seen through its stack's layout (A (E, r, d₂), B (E, d₁, r): views of
        the parameters, so a copy into them writes the stack's own tensor): the same names and shapes on every stack,
        for starting two stacks from the same adapters (``copy_adapters``)."""
        out: dict[str, torch.Tensor] = dict(self.adapters)
        for name, ex in self.experts.items():
            out[f"{name}.lora_A"], out[f"{name}.lora_B"] = ex.factors()
        return out

    def describe(self, cfg: TierConfig) -> str:
        lora = cfg.lora
        return (
            f"{cfg.model.name}: {self.built.source}; weights={self.built.weights}; {cfg.dtype} base"
            f"{' stored as NF4' if self.quantize else ''}; LoRA r={lora.r} alpha={lora.alpha} on {list(lora.targets)}"
            f"{f' and expert parameters {list(lora.target_parameters)}' if self.experts else ''} "
            f"({len(self.replaced)} layers, {lora.dtype_name or cfg.dtype} adapters, implementation "
            f"{self.implementation.name}); data {cfg.data.source} "
            f"{cfg.data.batch_size}x{cfg.data.seq_len}"
        )


def fit_to_implementation(
    cfg: TierConfig, impl: LoRAImplementation, source: str
) -> tuple[TierConfig, list[tuple[str, str]]]:
    """``cfg`` changed where ``impl`` declares it cannot do what ``cfg`` (read from ``source``) asks, with one
    (what is not applicable and what runs instead, the implementation's reason) per change, for the report:

    - an NF4 base and ``nf4_base`` n/a: the 16-bit base;  a 16-bit base and ``bf16_base`` n/a: an NF4 base;
    - fp32 adapters on a 16-bit base and ``fp32_adapters_on_16bit_base`` n/a: adapters in the base's dtype;
    - rsLoRA and ``rslora`` n/a: alpha / r;  captured steps and ``cuda_graph_capture`` n/a: eager steps;
    - targets covering part of a fusable group (q and v) and ``partial_groups`` n/a: the whole group (q, k, v).
    A tier records each pair as not applicable, so nothing runs differently without the report saying so."""
    why = impl.reason_not_applicable
    lora, train = cfg.lora, cfg.train
    notes: list[tuple[str, str]] = []
    if lora.quantize and (reason := why("nf4_base")):
        notes.append((f"{lora.quantize} base ({source} lora.quantize); the tier runs on the {cfg.dtype} base", reason))
        lora = dataclasses.replace(lora, quantize=None)
    elif not lora.quantize and (reason := why("bf16_base")):
        notes.append((f"{cfg.dtype} base ({source} lora.quantize: null); the tier runs on an NF4 base", reason))
        lora = dataclasses.replace(lora, quantize="nf4")
    if (
        lora.dtype_name == "float32"
        and cfg.dtype in ("bfloat16", "float16")
        and (reason := why("fp32_adapters_on_16bit_base"))
    ):
        notes.append(
            (
                f"float32 adapters on the {cfg.dtype} base ({source} lora.adapter_dtype); the tier runs "
                f"{cfg.dtype} adapters",
                reason,
            )
        )
        lora = dataclasses.replace(lora, adapter_dtype=cfg.dtype)
    if lora.use_rslora and (reason := why("rslora")):
        notes.append((f"rsLoRA ({source} lora.use_rslora); the tier scales by alpha / r", reason))
        lora = dataclasses.replace(lora, use_rslora=False)
    partial = why("partial_groups")
    widened = _whole_groups(lora.targets) if partial else tuple(lora.targets)
    if partial and widened != tuple(lora.targets):
        notes.append(
            (f"LoRA on {list(lora.targets)} only ({source} lora.targets); the tier adapts {list(widened)}", partial)
        )
        lora = dataclasses.replace(lora, targets=widened)
    if train.cuda_graph and (reason := why("cuda_graph_capture")):
        notes.append((f"captured training steps ({source} train.cuda_graph); the tier runs its steps eagerly", reason))
        train = dataclasses.replace(train, cuda_graph=False)
    return dataclasses.replace(cfg, lora=lora, train=train), notes


def _whole_groups(targets) -> tuple[str, ...]:
    """``targets`` with every fusable group they touch completed (q and v -> q, k, v), in the groups' order."""
    from lora_core.fuse import GROUPS

    out = list(targets)
    for group in GROUPS.values():
        if any(t in targets for t in group):
            out += [t for t in group if t not in out]
    return tuple(out)


def targets_left_out(model: nn.Module, targets, adapted: list[str]) -> list[str]:
    """Plain ``nn.Linear`` layers (of any subclass) that ``targets`` select but that hold no adapter and sit in no
    adapted module: what an implementation that skipped a target leaves behind. "all-linear" selects every linear
    but the LM head; a layer an implementation wraps keeps its base under its own path (``<path>.base_layer``),
    which is inside the adapted module."""
    targets, inside = tuple(targets), tuple(adapted)
    out = []
    for path, m in model.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        chosen = leaf in targets or ("all-linear" in targets and leaf != "lm_head")
        if isinstance(m, nn.Linear) and chosen and not any(path == a or path.startswith(a + ".") for a in inside):
            out.append(path)
    return out


def adapter_spec(cfg: TierConfig, quantize: str | None) -> AdapterSpec:
    """The tier's LoRA settings (``cfg.lora``: the spec an implementation is given) on the base ``quantize``."""
    return dataclasses.replace(cfg.lora, quantize=quantize)


def prepare(
    cfg: TierConfig,
    device: torch.device | str,
    *,
    implementation: LoRAImplementation | str | None = None,
    seed: int | None = None,
    quantize: str | None | Literal[True] = True,
    base_from: LoRAImplementation | None = None,
) -> Prepared:
    """Build, inject and batch per ``cfg``. ``quantize=True`` means the config's own setting.

    ``base_from``: with an NF4 base, the implementation whose own 4-bit storage the base gets before
    ``implementation`` injects (``LoRAImplementation.quantize_base``; peft-bnb: bitsandbytes' ``Linear4bit``),
    so a comparison run shares the quantised weights of the implementation under test. One without its own
    storage changes nothing.

    An implementation that injects per layer (``inject_per_layer``: lora_core's) gets each decoder layer as
    the model is built, so a QLoRA 7B model never exists in 16 bits as a whole; others get the whole model.
    """
    seed = cfg.train.seed if seed is None else seed
    quantize = cfg.lora.quantize if quantize is True else quantize
    impl = (
        implementation
        if isinstance(implementation, LoRAImplementation)
        else resolve_implementation(implementation or cfg.implementation)
    )
    spec = adapter_spec(cfg, quantize)
    impl.refuse_unsupported(spec)
    _refuse_what_impl_cannot(cfg, impl, spec, quantize)
    per_layer = impl.inject_per_layer
    # An implementation that trains only models its own loader read (load_model: Unsloth's) gets the built weights
    # in host memory, each decoder layer moved there as soon as it is built (one 16-bit layer on the GPU at a time,
    # as a loader reading a checkpoint), and quantises them itself as it loads them.
    own_loader = impl.has_own_loader()
    quantizer = _base_quantizer(impl, base_from, quantize, own_loader)
    torch.manual_seed(seed)  # adapter init (kaiming A) is the same for the same seed on every backend
    built = build_model(
        cfg.model,
        cfg.weights,
        DTYPES[cfg.dtype],
        device,
        seed=seed,
        on_layer=_on_layer_hook(impl, spec, quantizer, per_layer, own_loader),
    )
    if not per_layer:
        built = dataclasses.replace(built, model=impl.load_model(built.model, spec))
        impl.inject(built.model, spec)
    impl.finish_model(built.model, spec)
    adapters = impl.adapter_parameters(built.model)
    if not adapters:
        raise ValueError(
            f"implementation {impl.name!r} put no adapters into {cfg.model.name} for targets {list(spec.targets)}"
        )
    trained, experts = trained_parameters(impl, built.model, spec)
    _freeze_all_but(built.model, trained)
    replaced = adapted_modules(adapters) + list(experts)
    batches = Batches(cfg.data, tokenizer_for(built.tokenizer), cfg.model.architecture.vocab_size, device)
    return Prepared(built, built.model, batches, replaced, quantize, impl, trained, spec, experts)


def _refuse_what_impl_cannot(
    cfg: TierConfig, impl: LoRAImplementation, spec: AdapterSpec, quantize: str | None
) -> None:
    """Raise ``ImplementationError`` where ``cfg`` asks ``impl`` for what it declares not applicable: captured
    steps, fp32 adapters on a 16-bit base, a 16-bit base (checked in that order)."""
    no_capture = impl.reason_not_applicable("cuda_graph_capture")
    if cfg.train.cuda_graph and no_capture:
        raise ImplementationError(
            f"train.cuda_graph: true, but implementation {impl.name!r} cannot be captured: {no_capture}"
        )
    mixed = impl.reason_not_applicable("fp32_adapters_on_16bit_base")
    if mixed and cfg.dtype in ("bfloat16", "float16") and spec.adapter_dtype == torch.float32:
        raise ImplementationError(
            f"lora.adapter_dtype: float32 on a {cfg.dtype} base, but implementation {impl.name!r} cannot: {mixed}"
        )
    no_16bit = impl.reason_not_applicable("bf16_base")
    if no_16bit and quantize is None:
        raise ImplementationError(
            f"lora.quantize: null (a 16-bit base), but implementation {impl.name!r} cannot: {no_16bit}"
        )


def _base_quantizer(
    impl: LoRAImplementation, base_from: LoRAImplementation | None, quantize: str | None, own_loader: bool
) -> LoRAImplementation | None:
    """Whose 4-bit storage the base gets as the model is built: none for a 16-bit base, else ``base_from``'s, else
    ``impl``'s own, unless ``impl`` has its own loader (which quantises as it loads)."""
    # Whose 4-bit storage the base gets, layer by layer as the model is built (as transformers quantises while it
    # loads: a QLoRA model never exists in 16 bits as a whole, so its build does not set its peak): base_from's,
    # else the implementation's own (quantize_base returns False where it has none and injects per layer).
    quantizer = None if quantize is None else (base_from if base_from is not None else impl)
    if own_loader and quantizer is impl:
        quantizer = None
    return quantizer


def _on_layer_hook(
    impl: LoRAImplementation,
    spec: AdapterSpec,
    quantizer: LoRAImplementation | None,
    per_layer: bool,
    own_loader: bool,
) -> Callable[[nn.Module], None] | None:
    """What ``build_model`` does to each decoder layer as it is built: quantise its base (``quantizer``), inject
    (an implementation that injects per layer), move it to host memory (one with its own loader), in that order;
    None where there is nothing to do."""

    def on_layer(layer: nn.Module) -> None:
        if quantizer is not None:
            quantizer.quantize_base(layer)
        if per_layer:
            impl.inject(layer, spec)
        if own_loader:
            layer.to("cpu")

    return on_layer if per_layer or own_loader or quantizer is not None else None


def with_experts(adapters: dict[str, nn.Parameter], experts: dict[str, ExpertAdapter]) -> dict[str, nn.Parameter]:
    """Every tensor training updates: ``adapters`` and each expert adapter's A and B, as ``<expert parameter>.lora_A``
    and ``.lora_B`` (in the stack's own layout)."""
    out = dict(adapters)
    for name, ex in experts.items():
        out[f"{name}.lora_A"], out[f"{name}.lora_B"] = ex.a, ex.b
    return out


def trained_parameters(
    impl: LoRAImplementation, model: nn.Module, spec: AdapterSpec | None
) -> tuple[dict[str, nn.Parameter], dict[str, ExpertAdapter]]:
    """(every tensor training updates, by canonical name; the expert adapters): ``impl``'s adapters, then, where
    ``spec`` targets expert parameters, each expert adapter's A and B as ``<expert parameter>.lora_A`` / ``.lora_B``
    (read again after a load, which may put new tensors in place). None adapted for such a spec is a ValueError."""
    adapters = impl.adapter_parameters(model)
    experts = impl.expert_adapters(model) if spec is not None and spec.target_parameters else {}
    if spec is not None and spec.target_parameters and not experts:
        raise ValueError(
            f"implementation {impl.name!r} adapted no expert parameter of {type(model).__name__} for "
            f"target_parameters {list(spec.target_parameters)}"
        )
    return with_experts(adapters, experts), experts


def _freeze_all_but(model: nn.Module, adapters: dict[str, nn.Parameter]) -> None:
    """Freeze every parameter of ``model`` that is not one of ``adapters`` (embeddings, norms, LM head, base)."""
    adapter_ids = {id(a) for a in adapters.values()}
    for p in model.parameters():  # embeddings, norms, LM head: frozen
        if id(p) not in adapter_ids:
            p.requires_grad_(False)
