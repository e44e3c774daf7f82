"""What the bundled peers that swap each target ``nn.Linear`` for their own LoRA layer class share.

A subclass names its layer class (``library`` and ``layer_name``: ``layer_type`` once imported at selection) and its
``describe`` text (``description``), and says how to build one over a target (``wrap``), how to read its adapters,
rank and alpha (``adapters_of``, ``rank_alpha``) and whether it is switched off (``inactive``); the rest is the
contract done once: spec refusals with the declared reasons, target choice with lora_core's meaning of a target,
freezing, the dtype check, a forward-count hook (``served_by``'s evidence), PEFT-folder save/load.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from torch import nn

from lora_core.inject import replace_module, target_linears
from lora_suite.implementations import (
    AdapterSpec,
    ImplementationError,
    LoRAImplementation,
    adapted_modules,
    count_call,
    load_peft_tensors,
    require_module,
)


class WrappedLinearPeer(LoRAImplementation):
    library: str = ""  # the module that holds the layer class
    layer_name: str = ""  # the layer class's name in it
    description: str = ""  # describe()'s text; {version}: the installed version of the peer's namesake distribution
    layer_type: type[nn.Module] = nn.Module  # the layer class, once its library imports

    def __init__(self):
        self.layer_type = getattr(require_module(self.name, self.library), self.layer_name)

    def describe(self) -> str:
        import importlib.metadata

        return self.description.format(version=importlib.metadata.version(self.name))

    def wrap(self, linear: nn.Linear, spec: AdapterSpec) -> nn.Module:
        """A layer of ``layer_type`` over ``linear``'s own weight and bias, adapters initialised the library's way."""
        raise NotImplementedError

    def adapters_of(self, layer: nn.Module) -> tuple[nn.Parameter, nn.Parameter]:
        """(A (r, in), B (out, r)) of one layer."""
        raise NotImplementedError

    def rank_alpha(self, layer: nn.Module) -> tuple[int, float]:
        raise NotImplementedError

    def inactive(self, layer: nn.Module) -> str | None:
        """Why the layer's adapters would not run (merged, disabled), or None."""
        return None

    def inject(self, model, spec: AdapterSpec):
        if spec.quantize is not None:
            raise ImplementationError(f"{self.name}: quantize={spec.quantize!r}: {self.not_applicable['nf4_base']}")
        if spec.use_rslora:
            raise ImplementationError(f"{self.name}: use_rslora=True: {self.not_applicable['rslora']}")
        chosen = target_linears(model, tuple(spec.targets))
        if not chosen:
            raise ImplementationError(
                f"{self.name}: targets {list(spec.targets)} adapted no layer of {type(model).__name__}"
            )
        for p in model.parameters():
            p.requires_grad_(False)
        for path, linear in chosen:
            dtype = spec.adapter_dtype or linear.weight.dtype
            if dtype != linear.weight.dtype:
                raise ImplementationError(
                    f"{self.name}: adapter dtype {dtype} on a {linear.weight.dtype} base at "
                    f"{path}: {self.not_applicable['fp32_adapters_on_16bit_base']}"
                )
            leaf = path.rsplit(".", 1)[-1]  # the library builds each layer with its own r and alpha
            own = dataclasses.replace(
                spec, r=spec.rank_of(leaf), alpha=spec.alpha_of(leaf), rank_pattern=(), alpha_pattern=()
            )
            layer = self.wrap(linear, own)
            layer._lora_suite_calls = 0  # type: ignore[assignment]  # torch stub: Module.__setattr__ takes Tensor/Module
            layer.register_forward_hook(count_call)
            replace_module(model, path, layer)
        model._lora_suite_patterns = {"rank_pattern": spec.ranks, "alpha_pattern": spec.alphas}  # for the folder
        return [path for path, _ in chosen]

    def _base_rank_alpha(self, layers, model, patterns) -> tuple[int, float]:
        """The folder's r and lora_alpha: those of a layer no pattern overrides (every layer's where none does)."""
        named = {path.rsplit(".", 1)[-1]: m for path, m in model.named_modules() if isinstance(m, self.layer_type)}
        plain = [m for leaf, m in named.items() if leaf not in patterns["rank_pattern"]]
        r = self.rank_alpha(plain[0] if plain else layers[0])[0]
        plain = [m for leaf, m in named.items() if leaf not in patterns["alpha_pattern"]]
        return r, self.rank_alpha(plain[0] if plain else layers[0])[1]

    def adapter_parameters(self, model):
        out = {}
        for path, m in model.named_modules():
            if isinstance(m, self.layer_type):
                out[f"{path}.lora_A"], out[f"{path}.lora_B"] = self.adapters_of(m)
        return out

    def save_adapter(self, model, path):
        layers = [m for m in model.modules() if isinstance(m, self.layer_type)]
        if not layers:
            raise ImplementationError(f"{self.name}: the model has no {self.layer_type.__name__} layers to save")
        adapters = self.adapter_parameters(model)
        patterns = _patterns(model)
        r, alpha = self._base_rank_alpha(layers, model, patterns)
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": r,
            "lora_alpha": alpha,
            "use_rslora": False,
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "target_modules": sorted({p.rsplit(".", 1)[-1] for p in adapted_modules(adapters)}),
            **patterns,
        }
        return save_peft_tensors(adapters, config, path)

    def load_adapter(self, model, path):
        layers = [m for m in model.modules() if isinstance(m, self.layer_type)]
        expect = None
        if layers:
            patterns = _patterns(model)
            r, alpha = self._base_rank_alpha(layers, model, patterns)
            expect = {"r": r, "lora_alpha": alpha, "use_rslora": False, **patterns}
        load_peft_tensors(self.name, self.adapter_parameters(model), path, expect)

    def served_by(self, model):
        """``expected_path`` when every adapted layer is a ``layer_type``, active, and has run a forward."""

        def wrong(m):
            return None if isinstance(m, self.layer_type) else f"{type(m).__name__} (not a {self.layer_type.__name__})"

        return self.served_by_adapted_layers(model, wrong, self.inactive)


def save_peft_tensors(adapters: dict[str, nn.Parameter], config: dict, path: str | Path) -> Path:
    """Write ``adapters`` (canonical names) and ``config`` as a PEFT folder (PEFT's key names)."""
    from safetensors.torch import save_file

    from lora_core.adapters import CONFIG_FILE, PREFIX, WEIGHTS_FILE
    from lora_suite.implementations.peft_names import folder_key

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    save_file(
        {folder_key(name, PREFIX): p.detach().to("cpu").contiguous() for name, p in adapters.items()},
        str(path / WEIGHTS_FILE),
        metadata={"format": "pt"},
    )
    return path


def _patterns(model: nn.Module) -> dict[str, dict]:
    """The per-module overrides ``inject`` adapted ``model`` with (PEFT's names), empty where it had none."""
    return getattr(model, "_lora_suite_patterns", {"rank_pattern": {}, "alpha_pattern": {}})
