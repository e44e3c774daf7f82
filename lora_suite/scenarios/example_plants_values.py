"""Planted defects of two classes the fixed grids cannot see, in copies of the shipped example (each factory is
``--lora-impl lora_suite.scenarios.example_plants:<name>``; ``example_plant_table.PLANTS`` names the check that must
catch it):

- values that happen to be exact: a scale rounded through bf16 (exact at the grids' 12/8 and 12/√16, off at a drawn
  7.3/3 in every fp32 path), a merged delta formed in bf16 (inside bf16's output tolerance, many ulps of the merged
  weight where W and the delta nearly cancel);
- non-finite values cleaned on the way: NaN/Inf replaced in the adapters' gradients, or in the input of the LoRA
  path, so that a diverging run trains on looking healthy.
"""

from __future__ import annotations

import torch

from lora_suite.scenarios.example_plant_base import _example, _forward_plant, _layer_init_then, _lora, _planted


def scale_rounded_bf16():
    """s = alpha / r kept as a bf16 number (a scale tensor made in the base's 16-bit dtype, read back as a float)."""

    def init(layer, example_init, base, r, alpha, use_rslora, adapter_dtype):
        example_init(base, r, alpha, use_rslora, adapter_dtype)
        layer.scale = float(torch.tensor(layer.scale, dtype=torch.bfloat16))

    return _layer_init_then("scale_rounded_bf16", init)


def merge_delta_bf16():
    """merge_adapters forms s·B·A from the adapters cast to bf16 (a 16-bit GEMM, rounded), then adds it to W."""

    def merge_adapters(self, model):
        for path, m in self.layers(model).items():
            with torch.no_grad():
                delta = (m.scale * (m.lora_B.bfloat16() @ m.lora_A.bfloat16())).float()
                m.base.weight.copy_((m.base.weight.float() + delta).to(m.base.weight.dtype))
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, m.base)

    return _planted("merge_delta_bf16", merge_adapters=merge_adapters)


def adapter_grads_nan_to_num():
    """inject registers a hook on every adapter that replaces NaN/Inf in its gradient (by 0 and the largest finite)."""
    example_inject = _example().PlainLoRA.inject

    def inject(self, model, spec):
        adapted = example_inject(self, model, spec)
        for m in self.layers(model).values():
            for p in (m.lora_A, m.lora_B):
                p.register_hook(torch.nan_to_num)
        return adapted

    return _planted("adapter_grads_nan_to_num", inject=inject)


def _cleaned_input(self, x):
    self.calls += 1
    a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
    return self.base(x) + self.scale * _lora(self, torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), a, b)


lora_input_nan_to_num = _forward_plant("lora_input_nan_to_num", _cleaned_input)


def _a_cleaned(self, x):
    self.calls += 1
    a, b = torch.nan_to_num(self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype)
    return self.base(x) + self.scale * _lora(self, x, a, b)


# NaN/Inf replaced in A as the forward casts it (an Inf becomes the largest float, which the product overflows back
# to Inf: only a NaN shows it)
lora_a_nan_to_num = _forward_plant("lora_a_nan_to_num", _a_cleaned)
