"""The built-in ``peft``: PEFT's LoRA layers, and the PEFT-format adapter files every implementation reads
and writes."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from lora_suite.implementations import peft_names
from lora_suite.implementations.contract import ImplementationError, LoRAImplementation, adapted_modules

if TYPE_CHECKING:  # imported where adapters are handled (contract.py says why)
    import torch
    from torch import nn

    from lora_suite.settings.config import AdapterSpec

TUNER = "_lora_suite_tuner"  # the model's attribute holding PEFT's LoraModel (not a submodule)
# AdapterSpec.init -> PEFT's init_lora_weights
PEFT_INIT = {"default": True, "gaussian": "gaussian", "random_b": False, "pissa": "pissa", "olora": "olora"}


class PeftImplementation(LoRAImplementation):
    """PEFT's LoRA layers, put into the model with ``peft.inject_adapter_in_model`` (adapter name ``default``).

    The model stays the Hugging Face model (no ``PeftModel`` wrapper), so the trainer and the checks treat it
    like any other. Dropout 0 and PEFT's default initialisation; adapters cast to the spec's dtype.
    """

    name = expected_path = "peft"
    not_applicable = {
        "nf4_base": "PEFT builds a 4-bit base only through bitsandbytes: that is the peft-bnb implementation; "
        "lora_core's NF4 storage is not a layer PEFT can wrap",
        "op_call_count": "PEFT's layers keep no call counter; served_by() checks the layer types instead",
        "lora_core_ops": "these tests call lora_core's cupy op and kernels directly, which PEFT does not use",
    }

    def describe(self) -> str:
        import peft

        return f"peft: PEFT {peft.__version__} LoRA layers (peft.tuners.lora), eager torch ops"

    def inject(self, model, spec):
        import peft

        if spec.quantize is not None:
            raise ImplementationError(
                f"peft: quantize={spec.quantize!r} is not supported: {self.not_applicable['nf4_base']}"
            )
        config = peft.LoraConfig(**self.lora_config_args(spec))
        for p in model.parameters():
            p.requires_grad_(False)
        # what peft.inject_adapter_in_model does, its LoraModel kept (outside the module tree) for the operations
        # PEFT offers on it only: add_weighted_adapter
        model.__dict__[TUNER] = peft.tuners.lora.LoraModel(model, config, adapter_name="default")
        model._lora_suite_peft_config = config  # for save_adapter
        return self.count_and_train(model, spec)

    @staticmethod
    def lora_config_args(spec: AdapterSpec) -> dict:
        """PEFT's ``LoraConfig`` arguments for ``spec`` (dropout 0, no base bias trained)."""
        return dict(
            r=spec.r,
            lora_alpha=spec.alpha,
            target_modules="all-linear" if tuple(spec.targets) == ("all-linear",) else list(spec.targets),
            lora_dropout=0.0,
            use_rslora=spec.use_rslora,
            bias="none",
            rank_pattern=spec.ranks,
            alpha_pattern=spec.alphas,
            lora_bias=spec.lora_bias,
            layers_to_transform=list(spec.layers_to_transform) or None,
            modules_to_save=list(spec.modules_to_save) or None,
            init_lora_weights=PEFT_INIT[spec.init],
            use_dora=spec.use_dora,
            target_parameters=list(spec.target_parameters) or None,
        )

    def count_and_train(self, model, spec: AdapterSpec) -> list[str]:
        """After PEFT's injection: the adapted modules (none is an error naming the targets), a forward-count hook
        on each (``served_by``'s evidence), the adapters trainable in ``spec``'s dtype; returns the modules."""
        adapters = self.adapter_parameters(model)
        if not adapters:
            raise ImplementationError(
                f"{self.name}: targets {list(spec.targets)} adapted no layer of {type(model).__name__}"
            )
        for path in adapted_modules(adapters):
            layer = model.get_submodule(path)
            layer._lora_suite_calls = 0
            layer.register_forward_hook(count_call)
        trainable_in(adapters, spec.adapter_dtype)
        options = self.option_parameters(model)
        trainable_in({n: p for n, p in options.items() if peft_names.SAVED not in n}, spec.adapter_dtype)
        trainable_in(options, None)
        trainable_in(self._active(model, "expert"), spec.adapter_dtype)
        return adapted_modules(adapters)

    def adapter_parameters(self, model):
        """The active adapter's tensors (``default`` unless ``set_active_adapter`` chose another) by canonical name
        (``peft_names``: ``<path>.lora_A`` and ``.lora_B``, ``.lora_embedding_A`` and ``_B`` on an embedding)."""
        return self._active(model, "adapter")

    def option_parameters(self, model):
        """The active adapter's B bias, DoRA magnitude and saved module copies, by canonical name (``peft_names``)."""
        return self._active(model, "option")

    def expert_adapters(self, model):
        """Each PEFT ``ParamWrapper`` of the active adapter (``peft_names.expert_adapters``)."""
        return peft_names.expert_adapters(model, self._active(model, "expert"))

    def _held(self, model) -> dict:
        """Every tensor a folder holds: the adapters, what the options add (``option_parameters``) and the expert
        adapters (the ParamWrappers' A and B, by the wrapper's path)."""
        return {**self.adapter_parameters(model), **self.option_parameters(model), **self._active(model, "expert")}

    def _active(self, model, group: str) -> dict:
        """The active adapter's parameters of ``group``: "adapter" (A and B of a linear or embedding), "option",
        or "expert" (a ``ParamWrapper``'s A and B, by the wrapper's path)."""
        from peft.tuners.lora.layer import ParamWrapper

        out, active, experts = {}, {}, {}
        for name, p in model.named_parameters():
            found = peft_names.canonical(name)
            if found is None:
                continue
            path = peft_names.owner(found[0])
            if path not in active:
                layer = model.get_submodule(path)
                active[path] = set(getattr(layer, "active_adapters", None) or ["default"])
                experts[path] = isinstance(layer, ParamWrapper)
            kind = "expert" if experts[path] and found[2] == "adapter" else found[2]
            if kind == group and found[1] in active[path]:
                out[found[0]] = p
        return out

    def add_named_adapter(self, model, name, spec):
        """PEFT's ``inject_adapter_in_model`` again under ``name``: each LoRA layer gains the adapter (its own init,
        in the active adapter's dtype); the active adapter stays."""
        import peft

        config = getattr(model, "_lora_suite_peft_config", None)
        if config is None:
            raise ImplementationError(
                f"{self.name}: the model was not injected by this implementation (no LoRA config)"
            )
        active = self.adapter_parameters(model)
        dtype = next(iter(active.values())).dtype
        peft.inject_adapter_in_model(config, model, adapter_name=name)
        if TUNER in model.__dict__:
            model.__dict__[TUNER].peft_config[name] = config
        self._cast_adapter(model, name, dtype)
        for m in self._lora_layers(model):
            m.set_adapter(list(m.active_adapters))  # PEFT's own: the active adapter trainable, the others frozen

    def _cast_adapter(self, model, name: str, dtype) -> None:
        """Every layer's adapter ``name`` cast in place to ``dtype`` (PEFT makes a new adapter in its own dtype)."""
        for m in self._lora_layers(model):
            for which in (m.lora_A, m.lora_B):
                if name in which:
                    which[name].to(dtype)

    def set_active_adapter(self, model, name):
        """PEFT's ``LoraLayer.set_adapter(name)`` on every LoRA layer (the others frozen)."""
        for m in self._lora_layers(model):
            m.set_adapter(name)

    def delete_named_adapter(self, model, name):
        """PEFT's ``LoraLayer.delete_adapter(name)`` on every LoRA layer."""
        for m in self._lora_layers(model):
            m.delete_adapter(name)
        if TUNER in model.__dict__:
            model.__dict__[TUNER].peft_config.pop(name, None)

    def combine_adapters(self, model, names, weights, new):
        """PEFT's ``LoraModel.add_weighted_adapter(names, weights, new, combination_type="cat")`` on the model's own
        LoraModel, the new adapter cast to the active one's dtype and frozen; each layer's active adapter kept."""
        tuner = model.__dict__.get(TUNER)
        if tuner is None:
            raise ImplementationError(f"{self.name}: the model was not injected by this implementation (no LoraModel)")
        dtype = next(iter(self.adapter_parameters(model).values())).dtype
        active = {id(m): list(m.active_adapters) for m in self._lora_layers(model)}
        tuner.add_weighted_adapter(list(names), list(weights), new, combination_type="cat")
        self._cast_adapter(model, new, dtype)
        for m in self._lora_layers(model):
            m.set_adapter(active.get(id(m), list(m.active_adapters)))

    def save_adapter(self, model, path):
        from safetensors.torch import save_file

        from lora_core.adapters import PREFIX, WEIGHTS_FILE

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = getattr(model, "_lora_suite_peft_config", None)
        if config is None:
            raise ImplementationError("peft: the model was not injected by this implementation (no LoRA config)")
        config.save_pretrained(str(path))
        held = self._held(model)
        tensors = {peft_names.folder_key(n, PREFIX): p.detach().to("cpu").contiguous() for n, p in held.items()}
        save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
        return path

    def load_adapter(self, model, path):
        config = getattr(model, "_lora_suite_peft_config", None)
        expect = None
        if config is not None:
            expect = {"r": config.r, "lora_alpha": config.lora_alpha, "use_rslora": bool(config.use_rslora)}
            expect.update(rank_pattern=dict(config.rank_pattern or {}), alpha_pattern=dict(config.alpha_pattern or {}))
            expect.update(use_dora=bool(config.use_dora), lora_bias=bool(config.lora_bias))
        load_peft_tensors(self.name, self._held(model), path, expect)

    def merge_adapters(self, model):
        """PEFT's own merge of each LoRA layer (``LoraLayer.merge``: W += s·B·A, the layer then skips its adapters)."""
        from peft.tuners.lora import LoraLayer

        for m in model.modules():
            if isinstance(m, LoraLayer):
                m.merge()

    def _lora_layers(self, model):
        from peft.tuners.lora import LoraLayer

        return [m for m in model.modules() if isinstance(m, LoraLayer)]

    def unmerge_adapters(self, model):
        """PEFT's own unmerge of each LoRA layer (``LoraLayer.unmerge``: W −= s·B·A, the adapters apply again)."""
        for m in self._lora_layers(model):
            m.unmerge()

    @contextmanager
    def disabled_adapters(self, model):
        """PEFT's ``enable_adapters(False)`` on every tuner layer for the block, ``enable_adapters(True)`` after it
        whatever happens inside (what ``PeftModel.disable_adapter`` does)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        for m in layers:
            m.enable_adapters(False)
        try:
            yield
        finally:
            for m in layers:
                m.enable_adapters(True)

    def set_adapter_scale(self, model, factor):
        """PEFT's ``LoraLayer.set_scale(adapter, factor)`` on every LoRA layer, for each of its adapters."""
        for m in self._lora_layers(model):
            for adapter in list(m.scaling):
                m.set_scale(adapter, factor)

    def wrong_layer(self, m: nn.Module) -> str | None:
        """Why ``m`` is not the layer this implementation puts in, or None."""
        from peft.tuners.lora import LoraLayer

        return None if isinstance(m, LoraLayer) else f"{type(m).__name__} (not a PEFT LoRA layer)"

    def served_by(self, model):
        """``name`` when every adapted layer is the implementation's PEFT layer (``wrong_layer``), active (not
        merged, not disabled) and has run a forward (counted by a hook put there at injection); else what each
        offending layer is."""

        def inactive(m):
            return f"merged={m.merged} disabled={m.disable_adapters}" if m.merged or m.disable_adapters else None

        return self.served_by_adapted_layers(model, self.wrong_layer, inactive)


FLAGS = ("use_rslora", "use_dora", "lora_bias")  # a folder's flags: absent means False (PEFT's LoraConfig)


def _same_setting(key: str, got, want) -> bool:
    """Whether a folder's setting ``got`` is the model's ``want``: use_rslora as a bool, the patterns as {name:
    number} (absent = {}), r and lora_alpha as numbers."""
    if key in FLAGS:
        return bool(got) == bool(want)
    if key.endswith("_pattern"):
        got = got or {}
        return isinstance(got, dict) and {k: float(v) for k, v in got.items()} == {k: float(v) for k, v in want.items()}
    return got is not None and float(got) == float(want)


def load_peft_tensors(
    who: str, adapters: dict[str, nn.Parameter], path: str | Path, expect: dict | None = None
) -> None:
    """Copy a PEFT folder's tensors into ``adapters`` (canonical names), refusing keys that fit no adapter,
    adapters without a key and shapes that differ, each named; the config must parse, and its ``r``,
    ``lora_alpha`` and ``use_rslora`` must be the model's (``expect``): the same tensors under another scale
    are another model (issue 28: peft, loralib and torchtune resumed another alpha's checkpoint without a word)."""
    from safetensors.torch import load_file

    from lora_core.adapters import CONFIG_FILE, PREFIX, WEIGHTS_FILE

    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise ImplementationError(f"{who}: {path} has no {CONFIG_FILE}: not a PEFT folder")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())  # a broken config is an error here, not later
    except json.JSONDecodeError as exc:
        raise ImplementationError(f"{who}: {path / CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ImplementationError(f"{who}: {path / CONFIG_FILE} holds a JSON {type(config).__name__}, not an object")
    expect = dict(expect or {})
    if expect:  # per-module overrides: none unless the model has them (a loader that ignored them would load
        expect.setdefault("rank_pattern", {})  # the tensors under one scale)
        expect.setdefault("alpha_pattern", {})
    for key, want in expect.items():
        got = config.get(key, False if key in FLAGS else None)
        if not _same_setting(key, got, want):
            raise ImplementationError(
                f"{who}: {path / CONFIG_FILE} has {key}={got!r}, the model's adapters have {key}={want!r}: "
                "these tensors were trained under another scale"
            )
    tensors = load_file(str(path / WEIGHTS_FILE))
    by_key = {peft_names.folder_key(name, PREFIX): p for name, p in adapters.items()}
    unknown = sorted(set(tensors) - set(by_key))
    missing = sorted(set(by_key) - set(tensors))
    if unknown or missing:
        raise ImplementationError(
            f"{who}: {path}: keys that fit no adapter {unknown[:5]}, adapters without a key {missing[:5]}"
        )
    import torch

    with torch.no_grad():
        for key, p in by_key.items():
            if tensors[key].shape != p.shape:
                raise ImplementationError(
                    f"{who}: {key} has shape {tuple(tensors[key].shape)}, the model's adapter {tuple(p.shape)}"
                )
            p.copy_(tensors[key])


def trainable_in(adapters: dict[str, nn.Parameter], dtype: torch.dtype | None) -> None:
    """The adapters trainable, and in ``dtype`` (None: as the layers made them)."""
    import torch

    with torch.no_grad():
        for p in adapters.values():
            if dtype is not None and p.dtype != dtype:
                p.data = p.data.to(dtype)
            p.requires_grad_(True)


def count_call(module, args, output) -> None:
    module._lora_suite_calls += 1
