"""Microsoft's ``loralib`` (the LoRA paper's reference code, Hu et al. 2021): ``loralib.Linear`` on the targets.

How it is put in, and why:
- each target ``nn.Linear`` becomes a ``loralib.Linear`` built on the meta device, whose ``weight`` and ``bias``
  are then the original (shared, frozen) tensors, so no second copy of the base exists; ``lora_A`` (r, in) and
  ``lora_B`` (out, r) are new parameters initialised as loralib does (kaiming-uniform A with a = √5, zero B);
- ``merge_weights=False``: with loralib's default, ``model.eval()`` adds s·B·A into the base weight in place and
  ``train()`` subtracts it again, which would change the frozen base the suite checks and round it each time;
- dropout 0, ``fan_in_fan_out=False``; y = x Wᵀ + b + s · (x Aᵀ) Bᵀ with s = alpha / r (loralib's ``scaling``).
Not applicable, by design of loralib (its forward is its own): fp32 adapters on a 16-bit base (the adapters
must have the activations' dtype: ``x @ lora_A.T`` mixes dtypes otherwise), rsLoRA (s is alpha / r), an NF4
base, a count of op calls (served_by checks the layer types and a forward hook), lora_core's own ops.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lora_core.inject import replace_module, target_linears  # lora_core's meaning of a target
from lora_suite.implementations import (AdapterSpec, ImplementationError, LoRAImplementation, count_call,
                                        adapted_modules, load_peft_tensors, save_peft_tensors)


class LoralibImplementation(LoRAImplementation):
    name = expected_path = "loralib"
    not_applicable = {
        "fp32_adapters_on_16bit_base": "loralib's forward computes x @ lora_A.T in the activations' dtype; "
                                       "adapters must share the base's dtype (set lora.adapter_dtype to it)",
        "rslora": "loralib's scaling is alpha / r",
        "nf4_base": "loralib has no quantised base",
        "op_call_count": "loralib's layers keep no call counter; served_by() checks the layer types instead",
        "lora_core_ops": "these tests call lora_core's cupy op and kernels directly, which loralib does not use",
    }

    def __init__(self):
        try:
            import loralib  # noqa: F401
        except ImportError as exc:
            raise ImplementationError(f"--lora-impl loralib: loralib does not import ({exc}); install "
                                      "lora-gpu-suite[loralib]") from None

    def describe(self) -> str:
        import importlib.metadata
        return (f"loralib: Microsoft loralib {importlib.metadata.version('loralib')} loralib.Linear "
                f"(merge_weights=False), eager torch ops")

    def inject(self, model, spec: AdapterSpec):
        import loralib
        if spec.quantize is not None:
            raise ImplementationError(f"loralib: quantize={spec.quantize!r}: {self.not_applicable['nf4_base']}")
        if spec.use_rslora:
            raise ImplementationError(f"loralib: use_rslora=True: {self.not_applicable['rslora']}")
        chosen = target_linears(model, tuple(spec.targets))
        if not chosen:
            raise ImplementationError(f"loralib: targets {list(spec.targets)} adapted no layer of "
                                      f"{type(model).__name__}")
        for p in model.parameters():
            p.requires_grad_(False)
        for path, linear in chosen:
            base = linear.weight
            dtype = spec.adapter_dtype or base.dtype
            if dtype != base.dtype:
                raise ImplementationError(f"loralib: adapter dtype {dtype} on a {base.dtype} base at {path}: "
                                          f"{self.not_applicable['fp32_adapters_on_16bit_base']}")
            layer = loralib.Linear(linear.in_features, linear.out_features, r=spec.r, lora_alpha=spec.alpha,
                                   lora_dropout=0.0, merge_weights=False, bias=linear.bias is not None,
                                   device="meta")
            layer.weight, layer.bias = base, linear.bias
            layer.lora_A = nn.Parameter(torch.empty(spec.r, linear.in_features, device=base.device, dtype=dtype))
            layer.lora_B = nn.Parameter(torch.zeros(linear.out_features, spec.r, device=base.device, dtype=dtype))
            nn.init.kaiming_uniform_(layer.lora_A, a=math.sqrt(5))
            layer._lora_suite_calls = 0
            layer.register_forward_hook(count_call)
            replace_module(model, path, layer)
        return [path for path, _ in chosen]

    def adapter_parameters(self, model):
        import loralib
        out = {}
        for path, m in model.named_modules():
            if isinstance(m, loralib.Linear) and m.r > 0:
                out[f"{path}.lora_A"], out[f"{path}.lora_B"] = m.lora_A, m.lora_B
        return out

    def save_adapter(self, model, path):
        import loralib
        layers = [m for m in model.modules() if isinstance(m, loralib.Linear) and m.r > 0]
        if not layers:
            raise ImplementationError("loralib: the model has no loralib layers to save")
        adapters = self.adapter_parameters(model)
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": layers[0].r, "lora_alpha": layers[0].lora_alpha,
                  "use_rslora": False, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
                  "target_modules": sorted({p.rsplit(".", 1)[-1] for p in adapted_modules(adapters)})}
        return save_peft_tensors(adapters, config, path)

    def load_adapter(self, model, path):
        load_peft_tensors(self.name, self.adapter_parameters(model), path)

    def served_by(self, model):
        """"loralib" when every adapted layer is an unmerged ``loralib.Linear`` that has run a forward."""
        import loralib
        kinds = set()
        for path in adapted_modules(self.adapter_parameters(model)):
            m = model.get_submodule(path)
            if not isinstance(m, loralib.Linear):
                kinds.add(f"{type(m).__name__} (not a loralib layer)")
            elif m.merged:
                kinds.add("loralib, merged")
            elif not getattr(m, "_lora_suite_calls", 0):
                kinds.add("loralib layers that never ran")
            else:
                kinds.add("loralib")
        return ",".join(sorted(kinds))
