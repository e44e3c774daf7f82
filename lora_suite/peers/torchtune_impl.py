"""torchtune's ``torchtune.modules.peft.LoRALinear`` swapped into the Hugging Face model's target linears.

How it is put in, and why:
- each target ``nn.Linear`` becomes a ``LoRALinear`` built on the meta device (no second base is allocated),
  whose ``weight`` and ``bias`` are then the original shared, frozen tensors; its ``lora_a`` / ``lora_b``
  (``nn.Linear`` without bias) are materialised on the base's device with ``to_empty`` and initialised by
  torchtune's own ``initialize_parameters`` (kaiming-uniform A, zero B);
- canonical names: ``<path>.lora_A`` is ``lora_a.weight`` (r, in), ``<path>.lora_B`` is ``lora_b.weight``
  (out, r); y = x Wᵀ + b + (alpha / r) · B A x, dropout 0.
Not applicable: fp32 adapters on a 16-bit base (``lora_a`` is an ``nn.Linear`` applied to the activations, whose
dtype must match), rsLoRA (torchtune scales by alpha / r), an NF4 base (torchtune's QLoRA quantises with
torchao's ``to_nf4`` when the layer is constructed; this adapter does not build that path yet), a count of op
calls, lora_core's own ops.
"""

from __future__ import annotations

import torch
from torch import nn

from lora_core.inject import replace_module, target_linears  # lora_core's meaning of a target
from lora_suite.implementations import (AdapterSpec, ImplementationError, LoRAImplementation, count_call,
                                        adapted_modules, load_peft_tensors, save_peft_tensors)


class TorchtuneImplementation(LoRAImplementation):
    name = expected_path = "torchtune"
    not_applicable = {
        "fp32_adapters_on_16bit_base": "torchtune's lora_a is an nn.Linear applied to the activations; adapters "
                                       "must share the base's dtype (set lora.adapter_dtype to it)",
        "rslora": "torchtune's LoRALinear scales by alpha / rank",
        "nf4_base": "torchtune's QLoRA quantises the base with torchao's to_nf4 inside LoRALinear's constructor; "
                    "this adapter does not build that path yet",
        "op_call_count": "torchtune's layers keep no call counter; served_by() checks the layer types instead",
        "lora_core_ops": "these tests call lora_core's cupy op and kernels directly, which torchtune does not use",
    }

    def __init__(self):
        try:
            from torchtune.modules.peft import LoRALinear  # noqa: F401
        except ImportError as exc:
            raise ImplementationError(f"--lora-impl torchtune: torchtune does not import ({exc}); install "
                                      "lora-gpu-suite[torchtune]") from None

    def describe(self) -> str:
        import importlib.metadata
        return f"torchtune: torchtune {importlib.metadata.version('torchtune')} modules.peft.LoRALinear, eager torch ops"

    def inject(self, model, spec: AdapterSpec):
        from torchtune.modules.peft import LoRALinear
        if spec.quantize is not None:
            raise ImplementationError(f"torchtune: quantize={spec.quantize!r}: {self.not_applicable['nf4_base']}")
        if spec.use_rslora:
            raise ImplementationError(f"torchtune: use_rslora=True: {self.not_applicable['rslora']}")
        chosen = target_linears(model, tuple(spec.targets))
        if not chosen:
            raise ImplementationError(f"torchtune: targets {list(spec.targets)} adapted no layer of "
                                      f"{type(model).__name__}")
        for p in model.parameters():
            p.requires_grad_(False)
        for path, linear in chosen:
            base = linear.weight
            dtype = spec.adapter_dtype or base.dtype
            if dtype != base.dtype:
                raise ImplementationError(f"torchtune: adapter dtype {dtype} on a {base.dtype} base at {path}: "
                                          f"{self.not_applicable['fp32_adapters_on_16bit_base']}")
            with torch.device("meta"):
                layer = LoRALinear(linear.in_features, linear.out_features, rank=spec.r, alpha=spec.alpha,
                                   dropout=0.0, use_bias=linear.bias is not None)
            layer.weight, layer.bias = base, linear.bias
            layer.to_empty(device=base.device)  # torchtune's own: materialises lora_a and lora_b only
            layer.lora_a.to(dtype)  # nn.Module.to casts in place
            layer.lora_b.to(dtype)
            with torch.no_grad():
                layer.initialize_parameters()
            layer._lora_suite_calls = 0
            layer.register_forward_hook(count_call)
            replace_module(model, path, layer)
        return [path for path, _ in chosen]

    def adapter_parameters(self, model):
        from torchtune.modules.peft import LoRALinear
        out = {}
        for path, m in model.named_modules():
            if isinstance(m, LoRALinear):
                out[f"{path}.lora_A"], out[f"{path}.lora_B"] = m.lora_a.weight, m.lora_b.weight
        return out

    def save_adapter(self, model, path):
        from torchtune.modules.peft import LoRALinear
        layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
        if not layers:
            raise ImplementationError("torchtune: the model has no torchtune LoRA layers to save")
        adapters = self.adapter_parameters(model)
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": layers[0].rank, "lora_alpha": layers[0].alpha,
                  "use_rslora": False, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
                  "target_modules": sorted({p.rsplit(".", 1)[-1] for p in adapted_modules(adapters)})}
        return save_peft_tensors(adapters, config, path)

    def load_adapter(self, model, path):
        load_peft_tensors(self.name, self.adapter_parameters(model), path)

    def served_by(self, model):
        """"torchtune" when every adapted layer is torchtune's LoRALinear, enabled, not merged, and has run."""
        from torchtune.modules.peft import LoRALinear
        kinds = set()
        for path in adapted_modules(self.adapter_parameters(model)):
            m = model.get_submodule(path)
            if not isinstance(m, LoRALinear):
                kinds.add(f"{type(m).__name__} (not a torchtune LoRALinear)")
            elif m.disabled or getattr(m, "merged", False):
                kinds.add(f"torchtune, disabled={m.disabled} merged={getattr(m, 'merged', False)}")
            elif not getattr(m, "_lora_suite_calls", 0):
                kinds.add("torchtune layers that never ran")
            else:
                kinds.add("torchtune")
        return ",".join(sorted(kinds))
