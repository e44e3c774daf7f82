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

from lora_suite.implementations.wrapped import WrappedLinearPeer

_ONE_INIT = "loralib.Linear's reset_parameters draws lora_A kaiming-uniform (a = √5) and zeroes lora_B: no other init"


class LoralibImplementation(WrappedLinearPeer):
    name = expected_path = "loralib"
    operation_reasons = {
        "adapters": "loralib.Linear holds one adapter (lora_A, lora_B): there is no second one to add or switch to",
        "unmerge": "loralib folds its adapters into the weight on eval() and takes them out on train() (merge_weights), "
        "driven by the mode alone: it offers no merge or unmerge call (this adapter builds it with merge_weights=False)",
        "disable": "loralib.Linear has no switch that turns its adapters off for a call",
        "rescale": "loralib.Linear fixes its scaling lora_alpha / r at construction and offers no call to set it",
    }
    not_applicable = {
        "fp32_adapters_on_16bit_base": "loralib's forward computes x @ lora_A.T in the activations' dtype; "
        "adapters must share the base's dtype (set lora.adapter_dtype to it)",
        "rslora": "loralib's scaling is alpha / r",
        "nf4_base": "loralib has no quantised base",
        "op_call_count": "loralib's layers keep no call counter; served_by() checks the layer types instead",
        "lora_core_ops": "these tests call lora_core's cupy op and kernels directly, which loralib does not use",
        "moe_experts": "loralib adapts nn.Linear (and Embedding, Conv) layers; 3-D expert parameters are none of them",
        "lora_bias": "loralib.Linear's adapters are the matrices lora_A and lora_B: it has no bias on B",
        "layers_to_transform": "loralib takes no list of layers: the caller replaces each layer it wants by a "
        "loralib.Linear",
        "modules_to_save": "loralib trains its lora_ parameters (mark_only_lora_as_trainable); it keeps no trained copy "
        "of a whole module",
        "embedding_target": "loralib.Embedding keeps A as (r, vocab) and B as (hidden, r) but the suite's loralib "
        "adapter builds loralib.Linear layers only: not judged yet",
        "init_gaussian": _ONE_INIT,
        "init_random_b": _ONE_INIT,
        "init_pissa": _ONE_INIT,
        "init_olora": _ONE_INIT,
        "dora": "loralib implements LoRA only: it has no magnitude vector (DoRA)",
    }
    library, layer_name = "loralib", "Linear"
    description = "loralib: Microsoft loralib {version} loralib.Linear (merge_weights=False), eager torch ops"

    def wrap(self, linear, spec):
        base = linear.weight
        layer = self.layer_type(
            linear.in_features,
            linear.out_features,
            r=spec.r,
            lora_alpha=spec.alpha,
            lora_dropout=0.0,
            merge_weights=False,
            bias=linear.bias is not None,
            device="meta",
        )
        layer.weight, layer.bias = base, linear.bias
        layer.lora_A = nn.Parameter(torch.empty(spec.r, linear.in_features, device=base.device, dtype=base.dtype))
        layer.lora_B = nn.Parameter(torch.zeros(linear.out_features, spec.r, device=base.device, dtype=base.dtype))
        nn.init.kaiming_uniform_(layer.lora_A, a=math.sqrt(5))
        return layer

    def adapters_of(self, layer):
        return layer.lora_A, layer.lora_B

    def rank_alpha(self, layer):
        return layer.r, layer.lora_alpha

    def inactive(self, layer):
        return "merged" if layer.merged else None
