"""The contract every LoRA implementation meets (the package docstring, ``lora_suite.implementations``, says
what each method promises), the features it may declare it cannot do, its errors, and how a bundled peer reaches
its library (``require_module``, ``library_version``)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# What an implementation adapts: the LoRA settings' one shape, defined with the other settings (re-exported)
from lora_suite.settings.config import INITS as INIT_NAMES
from lora_suite.settings.config import AdapterSpec  # noqa: F401

# torch is imported where a model is adapted, not where an implementation is named: the controlling process of a run
# spread over workers resolves --lora-impl and imports no torch
if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn

from lora_suite.settings.implementation_names import DEFAULT, ENTRY_POINT_GROUP  # noqa: F401 (re-exported)

# What an implementation may declare it cannot do (key -> what it means).
FEATURES = {
    "nf4_base": "a 4-bit NF4 base weight under the adapters (QLoRA)",
    "op_call_count": "a count of LoRA op calls, to prove the path under test served them",
    "lora_core_ops": "lora_core's own op and kernels, tested below the model level",
    "cuda_graph_capture": "training steps captured in a CUDA graph (train.cuda_graph)",
    "fp32_adapters_on_16bit_base": "fp32 adapters over a 16-bit base (PEFT's default mixed precision)",
    "rslora": "rank-stabilised scaling s = alpha / sqrt(r)",
    "peft_default_init": "A drawn U(±1/√in) (kaiming-uniform, a = √5) and B zero: PEFT's init_lora_weights=True",
    "rank_pattern": "per-module rank and alpha overriding r and alpha (PEFT's rank_pattern and alpha_pattern)",
    "bf16_base": "a 16-bit base weight (lora.quantize: null)",
    "partial_groups": "LoRA on part of a fusable group of projections (q and v without k)",
    "autocast_fp32_inputs": "fp32 activations under torch.autocast (mixed precision over an fp32 model)",
    "inputs_2d": "2-D (tokens, features) inputs to a layer (a model always gives (batch, seq, features))",
    "linear_bias": "target linears that carry a bias (Qwen2's q/k/v): kept in the function, frozen",
    "fused_projections": "fused target linears by their own names (Phi-3's qkv_proj and gate_up_proj)",
    "moe_experts": "mixture-of-experts weights held as 3-D parameters (PEFT's target_parameters)",
    "gated_gelu_mlp": "an MLP whose gate is a GELU, not a SiLU (Gemma's GeGLU: gelu_pytorch_tanh)",
    "lora_bias": "a trainable bias b_B on B (PEFT's lora_bias): y = W·x + b + s·(B·A·x + b_B); merged, b + s·b_B",
    "layers_to_transform": "adapters on the listed decoder layers only (PEFT's layers_to_transform)",
    "modules_to_save": "whole modules trained as a copy and saved beside the adapters, the original kept and frozen "
    "(PEFT's modules_to_save)",
    "embedding_target": "LoRA on the input embedding, E' = E + s·(B·A)ᵀ with A (r, vocab), B (hidden, r) "
    "(PEFT's lora_embedding_A and lora_embedding_B)",
    "lm_head_target": "LoRA on the output projection (lm_head) as on any linear",
    "init_gaussian": "A drawn N(0, (1/r)²), B zero (PEFT's init_lora_weights='gaussian')",
    "init_random_b": "A and B both drawn: the adapter is not a no-op at the start (PEFT's init_lora_weights=False)",
    "init_pissa": "PiSSA: s·B·A the top-r singular part of W and the base W - s·B·A (PEFT's init_lora_weights='pissa')",
    "init_olora": "OLoRA: B·A = Q_r·R_r of W's QR and the base W - s·B·A (PEFT's init_lora_weights='olora')",
    "dora": "DoRA: W' = m ⊙ (W + s·B·A) / ‖W + s·B·A‖ per output row, the norm a constant in the backward "
    "(PEFT's use_dora)",
    "float64_reference_model": "a float64 copy of the whole model run in the same process (the architecture checks' "
    "reference): a stack that patches transformers' functions process-wide with kernels that take no float64 has none",
}


# The operations a user calls on an adapted model beyond training, each an optional method of the contract (operation ->
# (method, what it does)). One that an implementation does not override is recorded not applicable with
# ``operation_reason``: the stack offers no such call (or, where overridden there, the stack's own reason).
OPERATIONS = {
    "merge": ("merge_adapters", "fold s·B·A into every base weight (PEFT's merge)"),
    "unmerge": ("unmerge_adapters", "take a merged s·B·A out of every base weight and apply the adapters again"),
    "disable": (
        "disabled_adapters",
        "a context in which the model computes its base function (PEFT's disable_adapter)",
    ),
    "rescale": (
        "set_adapter_scale",
        "every adapter's scale set to a factor times alpha/r or alpha/√r (PEFT's set_scale)",
    ),
    "adapters": (
        "add_named_adapter",
        "hold several adapters under their names, one active (PEFT's add_adapter, set_adapter, delete_adapter)",
    ),
    "combine": (
        "combine_adapters",
        "a new adapter whose update is Σ wᵢ·sᵢ·Bᵢ·Aᵢ of adapters it holds (PEFT's add_weighted_adapter, 'cat')",
    ),
}


# AdapterSpec.init -> the feature a stack declares for it ("default" is PEFT's init_lora_weights=True)
INITS = {
    "default": "peft_default_init",
    "gaussian": "init_gaussian",
    "random_b": "init_random_b",
    "pissa": "init_pissa",
    "olora": "init_olora",
}
assert tuple(INITS) == INIT_NAMES, "one feature for each AdapterSpec.init value"
# Target names that are not decoder-layer linears, -> the feature a stack declares for them
SPECIAL_TARGETS = {"embed_tokens": "embedding_target", "lm_head": "lm_head_target"}


def spec_features(spec: AdapterSpec) -> list[str]:
    """The FEATURES ``spec`` asks of a stack beyond one plain adapter per target linear (its options, in order)."""
    out = [f for f in ("lora_bias", "layers_to_transform", "modules_to_save") if getattr(spec, f)]
    out += ["moe_experts"] if spec.target_parameters else []
    out += [SPECIAL_TARGETS[t] for t in spec.targets if t in SPECIAL_TARGETS]
    out += ["dora"] if spec.use_dora else []
    return out + ([INITS[spec.init]] if spec.init != "default" else [])


@dataclass(frozen=True)
class ExpertAdapter:
    """The adapter of one 3-D expert parameter W of shape (E, d₁, d₂) as stored: expert e's weight becomes

        W'ₑ = Wₑ + s·Bₑ·Aₑ,   Aₑ: (r, d₂),  Bₑ: (d₁, r)

    (s the spec's scale of the parameter's leaf name), the factors read from the stack's own trainable tensors ``a``
    and ``b`` through its layout: ``a3(t)`` gives (E, r, d₂), ``b3(t)`` (E, d₁, r), for the tensors themselves and
    for their gradients alike (PEFT: A (E·r, d₂) expert-major rows, B (d₁, r·E) expert-minor columns)."""

    a: nn.Parameter
    b: nn.Parameter
    a3: Callable[[torch.Tensor], torch.Tensor]
    b3: Callable[[torch.Tensor], torch.Tensor]

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A (E, r, d₂), B (E, d₁, r)) of the tensors now."""
        return self.a3(self.a.detach()), self.b3(self.b.detach())


class ImplementationError(ValueError):
    """An implementation that cannot be found, built, or that breaks the contract."""


WHEN = ("selection", "found", "use")  # where a peer asks for its library (require_module)


def require_module(impl: str, *modules: str, hint: str | None = None, when: str = "selection") -> Any:
    """The library of the bundled peer ``impl``: ``modules`` imported in turn, the last one returned; or an
    ImplementationError naming the module, why, and what to install (``hint``; by default the extra named after the
    peer, ``install lora-gpu-suite[<impl>]``). Every bundled peer reaches its library through it. ``when``:

    - ``"selection"``: a constructor, while ``--lora-impl`` is chosen; an ImportError is refused naming the option;
    - ``"found"``: a constructor that must not import its library yet (it imports torch, which the controlling process
      of workers never does, or patches transformers): each module is only looked up, every missing one named, and
      None returned;
    - ``"use"``: inject, preload or a loader, mid-run; whatever the import raises is named with its type.
    """
    if when not in WHEN:
        raise ValueError(f"when={when!r} is not one of {WHEN}")
    hint = hint or f"install lora-gpu-suite[{impl}]"
    if when == "found":
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            raise ImplementationError(f"--lora-impl {impl}: {', '.join(missing)} not installed; {hint}")
        return None
    module = None
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  (mid-run, an import that fails for any reason: say which and why)
            if when == "use":
                why = f"{type(exc).__name__}: {exc}"
                raise ImplementationError(f"{impl}: {name} does not import ({why}); {hint}") from None
            if isinstance(exc, ImportError):
                raise ImplementationError(f"--lora-impl {impl}: {name} does not import ({exc}); {hint}") from None
            raise
    return module


def library_version(dist: str) -> str:
    """The installed version of the distribution ``dist`` (what a peer's ``describe`` names), or "(version unknown)"."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


class LoRAImplementation:
    """Base class of the contract above. Subclasses set ``name``, ``expected_path`` and implement the methods."""

    name: str = ""
    expected_path: str = ""  # what served_by() returns when every adapted layer ran the path under test
    not_applicable: dict[str, str] = {}  # feature (FEATURES) -> why this implementation cannot do it
    operation_reasons: dict[str, str] = {}  # operation (OPERATIONS) it does not override -> the stack's own why
    # True: inject() may be given each decoder layer as the model is built (a quantised base then never exists
    # in 16 bits as a whole); False: it is given the whole model once built.
    inject_per_layer: bool = False
    # True: inject() also fuses the LM head and the loss (no logits in a training step, captured or eager), so
    # --fused-ops liger leaves its own fused linear cross-entropy out and nothing is missing from a captured step
    fuses_loss: bool = False
    # True: the stack patches transformers for the whole process (at its import, or module-level names), so the
    # architecture checks' float64 reference runs in a fresh process (lora_suite.judges.separate_reference)
    separate_reference: bool = False

    def describe(self) -> str:
        return self.name

    def preload(self) -> None:
        """Optional: import what must come before the model library, once, before any model is built (the pytest
        plugin calls it after selection). Unsloth patches transformers at its import and asks to be first."""

    def load_model(self, model: nn.Module, spec: AdapterSpec) -> nn.Module:
        """The model ``inject`` is given: ``model`` itself (the default), or, for a stack that trains only models
        read by its own loader (Unsloth's ``FastLanguageModel.from_pretrained``), the model it loaded from
        ``model``'s weights; ``model`` is then spent. Called once per whole model, never for per-layer injection."""
        return model

    def has_own_loader(self) -> bool:
        """Whether ``load_model`` is overridden: the suite then builds the weights in host memory for it, a layer at a
        time, and leaves quantisation to its loader."""
        return type(self).load_model is not LoRAImplementation.load_model

    def inject(self, model: nn.Module, spec: AdapterSpec) -> list[str]:
        raise NotImplementedError

    def finish_model(self, model: nn.Module, spec: AdapterSpec) -> None:
        """Optional: what the implementation does to the whole model beyond its layers, once every ``inject`` call
        (per layer or whole) is done, before training (cupy-fused: the fused LM head and loss)."""

    def adapter_parameters(self, model: nn.Module) -> dict[str, nn.Parameter]:
        raise NotImplementedError

    def save_adapter(self, model: nn.Module, path: str | Path) -> Path:
        raise NotImplementedError

    def load_adapter(self, model: nn.Module, path: str | Path) -> None:
        raise NotImplementedError

    def served_by(self, model: nn.Module) -> str:
        raise NotImplementedError

    def op_calls(self) -> int | None:
        return None

    def merge_adapters(self, model: nn.Module) -> None:
        """Optional: fold every adapter into its base weight in place (W + s·B·A), so that the model computes the
        same function without adapters (PEFT's ``merge``). Not overridden: the merged-weights check is recorded as
        not applicable (``merge_reason``)."""
        raise NotImplementedError

    def merge_reason(self) -> str | None:
        """Why the merged-weights check does not apply (None where ``merge_adapters`` is implemented)."""
        if type(self).merge_adapters is LoRAImplementation.merge_adapters:
            return f"{self.name} implements no merge_adapters (optional in the contract)"
        return None

    def unmerge_adapters(self, model: nn.Module) -> None:
        """Optional: undo ``merge_adapters``: every base weight back to W (W + s·B·A − s·B·A, rounded twice), the
        adapters applied again and trainable (PEFT's ``unmerge``)."""
        raise NotImplementedError

    def disabled_adapters(self, model: nn.Module) -> AbstractContextManager[None]:
        """Optional: a context manager inside which ``model`` computes its base function, the adapters kept; on exit,
        by an exception too, they apply again as before (PEFT's ``disable_adapter``)."""
        raise NotImplementedError

    def set_adapter_scale(self, model: nn.Module, factor: float) -> None:
        """Optional: every adapted layer's scale set to ``factor`` times its own (alpha/r, or alpha/√r under rsLoRA),
        not compounded with an earlier factor; ``factor`` 1 restores it (PEFT's ``LoraLayer.set_scale``)."""
        raise NotImplementedError

    def add_named_adapter(self, model: nn.Module, name: str, spec: AdapterSpec) -> None:
        """Optional, with ``set_active_adapter`` and ``delete_named_adapter``: a second adapter named ``name`` on the
        same targets (PEFT's ``add_adapter``), the active one unchanged. ``adapter_parameters`` always lists the active
        adapter's tensors under the canonical names; an inactive adapter is frozen and untouched by training."""
        raise NotImplementedError

    def set_active_adapter(self, model: nn.Module, name: str) -> None:
        """Make ``name`` the adapter every adapted layer applies and trains (PEFT's ``set_adapter``)."""
        raise NotImplementedError

    def delete_named_adapter(self, model: nn.Module, name: str) -> None:
        """Remove the inactive adapter ``name`` from every adapted layer (PEFT's ``delete_adapter``); the name may be
        added again."""
        raise NotImplementedError

    def combine_adapters(self, model: nn.Module, names: list[str], weights: list[float], new: str) -> None:
        """Optional, with ``add_named_adapter``: a new adapter ``new`` on the same layers whose update is exactly
        Σ wᵢ·sᵢ·Bᵢ·Aᵢ over the adapters ``names`` (their ranks concatenated: PEFT's ``add_weighted_adapter`` with
        combination ``cat``); the sources and the active adapter unchanged."""
        raise NotImplementedError

    def operation_reason(self, op: str) -> str | None:
        """Why the operation ``op`` (``OPERATIONS``) cannot be judged on this implementation, or None. Merge asks
        ``merge_reason``; the others, where the method is not overridden, say the stack offers no such call."""
        if op not in OPERATIONS:
            raise ValueError(f"operation {op!r} is not one of {sorted(OPERATIONS)}")
        if op == "merge":
            return self.merge_reason()
        method, what = OPERATIONS[op]
        if getattr(type(self), method) is getattr(LoRAImplementation, method):
            return self.operation_reasons.get(op) or f"{self.name} offers no {method} (to {what})"
        return None

    def served_by_adapted_layers(self, model: nn.Module, wrong_layer, inactive) -> str:
        """A ``served_by`` for implementations whose layers are counted by a forward hook (``count_call``):
        ``expected_path`` when every adapted layer is the right kind (``wrong_layer(m)`` is None), active
        (``inactive(m)`` is None) and has run a forward; else what each offending layer is, joined."""
        kinds = set()
        for path in adapted_modules(self.adapter_parameters(model)):
            m = model.get_submodule(path)
            if (wrong := wrong_layer(m)) is not None:
                kinds.add(wrong)
            elif (why := inactive(m)) is not None:
                kinds.add(f"{self.name}, {why}")
            elif not getattr(m, "_lora_suite_calls", 0):
                kinds.add(f"{self.name} layers that never ran")
            else:
                kinds.add(self.expected_path)
        return ",".join(sorted(kinds))

    def quantize_base(self, model: nn.Module) -> bool:
        """Put this implementation's own 4-bit storage into ``model``'s linears (all but the LM head), as its
        ``inject`` does for ``quantize="nf4"``, and return True; False (nothing done) where its NF4 base, if any,
        is lora_core's. Comparison runs (the torch reference, the control) are built on the same quantised
        weights this way (``prepare(..., base_from=)``), so they judge the LoRA layer and not two quantisers."""
        return False

    def refuse_unsupported(self, spec: AdapterSpec) -> None:
        """Raise ``ImplementationError`` naming each option of ``spec`` this stack declares it cannot do, with its
        reason: an option is never dropped on the way to a stack that does not have it (``spec_features``)."""
        whys = [f"{f} ({FEATURES[f]}): {why}" for f in spec_features(spec) if (why := self.reason_not_applicable(f))]
        if whys:
            raise ImplementationError(f"{self.name}: the LoRA settings ask for what it cannot do: " + "; ".join(whys))

    def option_parameters(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """The trainable tensors an option adds beyond A and B, by canonical name: ``<path>.lora_bias`` (B's bias),
        ``<path>.lora_magnitude`` (DoRA's m), ``<path>.saved.<name>`` (a ``modules_to_save`` copy's parameter).
        Empty by default: a stack without these options has none."""
        return {}

    def expert_adapters(self, model: nn.Module) -> dict[str, ExpertAdapter]:
        """The active adapter of each 3-D expert parameter adapted (``AdapterSpec.target_parameters``), by the
        parameter's name in the un-adapted model (``<experts path>.<parameter>``). Empty by default: a stack that
        adapts no expert parameter (``moe_experts`` declared not applicable) has none."""
        return {}

    def reason_not_applicable(self, feature: str) -> str | None:
        if feature not in FEATURES:
            raise ValueError(f"feature {feature!r} is not one of {sorted(FEATURES)}")
        return self.not_applicable.get(feature)


def adapted_modules(adapters: dict[str, nn.Parameter]) -> list[str]:
    """The module paths holding the adapters, in the adapters' order (``<path>.lora_A`` -> ``<path>``)."""
    return list(dict.fromkeys(name.rsplit(".", 1)[0] for name in adapters))
