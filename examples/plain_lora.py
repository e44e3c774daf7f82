"""A plain-torch LoRA implementation for lora-gpu-suite: the starting point for judging your own stack.

Copy this file into your project, replace ``PlainLoRALinear.forward`` (and whatever else) with your own code, and run

    lora-suite quick --lora-impl plain_lora:make          # with this file's folder on PYTHONPATH
    lora-suite convergence --lora-impl plain_lora:make
    lora-suite memory --lora-impl plain_lora:make

The suite talks to an implementation only through ``lora_suite.implementations.LoRAImplementation``:

- ``inject(model, spec)`` puts adapters on the target linears in place and freezes everything else;
- ``adapter_parameters(model)`` names each adapter ``<module path>.lora_A`` (r, in) / ``.lora_B`` (out, r);
- ``save_adapter`` / ``load_adapter`` write and read a PEFT-format folder (``adapter_config.json`` and
  ``adapter_model.safetensors`` with PEFT's key names), so PEFT itself can load what you save;
- ``served_by(model)`` says which code path served the latest forward (the suite refuses a silent fallback);
- ``merge_adapters(model)`` (optional) folds the adapters into the base weights, ``unmerge_adapters(model)`` takes
  them out again; ``disabled_adapters(model)`` (a context: the base model's function inside) and
  ``set_adapter_scale(model, factor)`` (PEFT's ``set_scale``) are optional too: drop what your stack does not offer;
- ``not_applicable`` names what the implementation cannot do, with the reason the report prints.

The layer computes y = x Wᵀ + s·(x Aᵀ) Bᵀ with s = alpha / r (alpha / √r with rsLoRA); A is kaiming-uniform and B
zero at the start, as in the LoRA paper and PEFT.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from lora_suite.implementations import ImplementationError, LoRAImplementation

PEFT_PREFIX = "base_model.model."  # PEFT's key of an adapter: base_model.model.<path>.lora_A.weight


class PlainLoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus trainable A (r, in) and B (out, r): y = x Wᵀ + b + s·(x Aᵀ) Bᵀ."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, use_rslora: bool, adapter_dtype: torch.dtype | None):
        super().__init__()
        self.base = base  # shares the model's weight: no second copy of the base
        self.r, self.alpha, self.use_rslora = r, alpha, use_rslora
        self.scale = alpha / (math.sqrt(r) if use_rslora else r)
        self.enabled = True  # False inside PlainLoRA.disabled_adapters: the base function
        w = base.weight
        dtype = adapter_dtype or w.dtype
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=w.device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=w.device, dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.calls = 0

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if not self.enabled:
            return self.base(x)
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)  # the adapters in the activations' dtype
        return self.base(x) + self.scale * F.linear(F.linear(x, a), b)


class PlainLoRA(LoRAImplementation):
    name = expected_path = "plain-lora"
    not_applicable = {
        "nf4_base": "plain-lora has no 4-bit base: it adapts 16-bit nn.Linear layers only",
        "op_call_count": "plain-lora keeps no count of op calls; served_by() checks each layer ran",
        "lora_core_ops": "lora_core's own op and kernels, which plain-lora does not use",
        "moe_experts": "plain-lora adapts nn.Linear layers; 3-D expert parameters are not linears",
        "lora_bias": "plain-lora's layer holds lora_A and lora_B only: no bias on B",
        "layers_to_transform": "plain-lora adapts every nn.Linear whose name is a target: it takes no list of layers",
        "modules_to_save": "plain-lora trains and saves its adapters only",
        "embedding_target": "plain-lora adapts nn.Linear layers only",
        "dora": "plain-lora computes W·x + s·B·A·x only (no DoRA magnitude)",
        **{
            f"init_{k}": "plain-lora draws A kaiming-uniform and B zero, PEFT's default: no other init"
            for k in ("gaussian", "random_b", "pissa", "olora")
        },
    }
    layer_type = PlainLoRALinear
    operation_reasons = {"adapters": "plain-lora's layer holds one adapter: there is no second one to add or switch to"}

    def describe(self) -> str:
        return "plain-lora: the suite's example implementation (examples/plain_lora.py), eager torch ops"

    def targets_of(self, model: nn.Module, targets: tuple[str, ...]) -> list[tuple[str, nn.Linear]]:
        """Every nn.Linear whose leaf name is a target ("all-linear": every one but the LM head)."""
        found = []
        for path, m in model.named_modules():
            leaf = path.rsplit(".", 1)[-1]
            if type(m) is nn.Linear and (leaf in targets or ("all-linear" in targets and leaf != "lm_head")):
                found.append((path, m))
        return found

    def inject(self, model, spec):
        if spec.quantize is not None:
            raise ImplementationError(f"plain-lora: quantize={spec.quantize!r}: {self.not_applicable['nf4_base']}")
        chosen = self.targets_of(model, tuple(spec.targets))
        if not chosen:
            raise ImplementationError(f"plain-lora: targets {list(spec.targets)} match no nn.Linear")
        for p in model.parameters():
            p.requires_grad_(False)
        for path, linear in chosen:
            parent, _, leaf = path.rpartition(".")  # r and alpha per module: spec.rank_pattern, alpha_pattern
            layer = self.layer_type(
                linear, spec.rank_of(leaf), spec.alpha_of(leaf), spec.use_rslora, spec.adapter_dtype
            )
            setattr(model.get_submodule(parent) if parent else model, leaf, layer)
        model._plain_lora = {"r": spec.r, "lora_alpha": spec.alpha, "use_rslora": spec.use_rslora}
        model._plain_lora.update(rank_pattern=spec.ranks, alpha_pattern=spec.alphas)  # PEFT's per-module overrides
        return [path for path, _ in chosen]

    def layers(self, model) -> dict[str, PlainLoRALinear]:
        return {path: m for path, m in model.named_modules() if isinstance(m, self.layer_type)}

    def adapter_parameters(self, model):
        out = {}
        for path, m in self.layers(model).items():
            out[f"{path}.lora_A"], out[f"{path}.lora_B"] = m.lora_A, m.lora_B
        return out

    def save_adapter(self, model, path):
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = model._plain_lora
        targets = sorted({p.rsplit(".", 1)[-1] for p in self.layers(model)})
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "target_modules": targets, "lora_dropout": 0.0}
        config.update(bias="none", fan_in_fan_out=False, **cfg)
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
        tensors = {
            f"{PEFT_PREFIX}{n}.weight": p.detach().cpu().contiguous() for n, p in self.adapter_parameters(model).items()
        }
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        return path

    def load_adapter(self, model, path):
        path = Path(path)
        config = json.loads((path / "adapter_config.json").read_text())
        for key, want in model._plain_lora.items():  # the same tensors under another scale are another model
            absent = False if key == "use_rslora" else {} if key.endswith("_pattern") else None
            if config.get(key, absent) != want:
                raise ImplementationError(f"plain-lora: {path} has {key}={config.get(key)!r}, the model {want!r}")
        tensors = load_file(str(path / "adapter_model.safetensors"))
        params = self.adapter_parameters(model)
        keys = {f"{PEFT_PREFIX}{n}.weight": p for n, p in params.items()}
        if set(keys) != set(tensors):
            raise ImplementationError(f"plain-lora: {path} keys differ from the model's adapters")
        with torch.no_grad():
            for key, p in keys.items():
                p.copy_(tensors[key])

    def served_by(self, model):
        ran = [m.calls > 0 for m in self.layers(model).values()]
        return self.expected_path if ran and all(ran) else f"plain-lora: {ran.count(False)} layers that never ran"

    def merge_adapters(self, model):
        """Fold each adapter into its base weight (W + s·B·A, in fp32, rounded once) and put the plain linear back
        (the LoRA layer is kept aside on the model, for ``unmerge_adapters``)."""
        merged = model.__dict__.setdefault("_plain_lora_merged", {})
        for path, m in self.layers(model).items():
            with torch.no_grad():
                delta = m.scale * (m.lora_B.float() @ m.lora_A.float())
                m.base.weight.copy_((m.base.weight.float() + delta).to(m.base.weight.dtype))
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, m.base)
            merged[path] = m

    def unmerge_adapters(self, model):
        """Take each merged adapter out of its base weight (W − s·B·A, in fp32, rounded once) and put its LoRA layer
        back."""
        for path, m in model.__dict__.pop("_plain_lora_merged", {}).items():
            with torch.no_grad():
                delta = m.scale * (m.lora_B.float() @ m.lora_A.float())
                m.base.weight.copy_((m.base.weight.float() - delta).to(m.base.weight.dtype))
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, m)

    @contextmanager
    def disabled_adapters(self, model):
        """Inside the block every layer computes its base function; after it (an exception too) the adapters again."""
        layers = list(self.layers(model).values())
        for m in layers:
            m.enabled = False
        try:
            yield
        finally:
            for m in layers:
                m.enabled = True

    def set_adapter_scale(self, model, factor):
        """Every layer's scale set to ``factor`` times alpha/r (alpha/√r with rsLoRA): PEFT's ``set_scale``."""
        for m in self.layers(model).values():
            m.scale = factor * m.alpha / (math.sqrt(m.r) if m.use_rslora else m.r)


def make() -> PlainLoRA:
    """The factory ``--lora-impl plain_lora:make`` calls."""
    return PlainLoRA()
