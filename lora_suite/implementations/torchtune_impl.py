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

from lora_suite.implementations.contract import require_module
from lora_suite.implementations.wrapped import WrappedLinearPeer

_ONE_INIT = "torchtune's LoRALinear.initialize_parameters draws lora_a kaiming-uniform and zeroes lora_b: no other init"


class TorchtuneImplementation(WrappedLinearPeer):
    name = expected_path = "torchtune"
    not_applicable = {
        "fp32_adapters_on_16bit_base": "torchtune's lora_a is an nn.Linear applied to the activations; adapters "
        "must share the base's dtype (set lora.adapter_dtype to it)",
        "rslora": "torchtune's LoRALinear scales by alpha / rank",
        "nf4_base": "torchtune's QLoRA quantises the base with torchao's to_nf4 inside LoRALinear's constructor; "
        "this adapter does not build that path yet",
        "op_call_count": "torchtune's layers keep no call counter; served_by() checks the layer types instead",
        "lora_core_ops": "these tests call lora_core's cupy op and kernels directly, which torchtune does not use",
        "moe_experts": "torchtune's LoRALinear wraps one linear; its MoE LoRA lives in its own expert modules, "
        "not transformers' 3-D parameters",
        "lora_bias": "torchtune's LoRALinear has no bias on lora_b (its use_bias is the base linear's)",
        "layers_to_transform": "torchtune takes no list of layers: its model builders adapt every layer of a kind "
        "(lora_attn_modules, apply_lora_to_mlp)",
        "modules_to_save": "torchtune trains and saves its adapter parameters (get_adapter_params); it keeps no "
        "trained copy of a whole module",
        "embedding_target": "torchtune has no LoRA layer for an embedding",
        "init_gaussian": _ONE_INIT,
        "init_random_b": _ONE_INIT,
        "init_pissa": _ONE_INIT,
        "init_olora": _ONE_INIT,
        "dora": "torchtune's DoRA is a separate layer (DoRALinear); the suite's torchtune adapter builds LoRALinear "
        "only: not judged yet",
    }
    operation_reasons = {
        "adapters": "torchtune's LoRALinear holds one adapter (lora_a, lora_b): there is no second one to add or switch to",
        "unmerge": "torchtune merges a state dict (get_merged_lora_ckpt) into a new checkpoint, never a model in place: "
        "there is nothing to unmerge",
        "rescale": "torchtune's LoRALinear fixes its scale alpha / rank at construction and offers no call to set it",
    }
    library, layer_name = "torchtune.modules.peft", "LoRALinear"
    description = "torchtune: torchtune {version} modules.peft.LoRALinear, eager torch ops"

    def wrap(self, linear, spec):
        with torch.device("meta"):
            layer = self.layer_type(
                linear.in_features,
                linear.out_features,
                rank=spec.r,
                alpha=spec.alpha,
                dropout=0.0,
                use_bias=linear.bias is not None,
            )
        layer.weight, layer.bias = linear.weight, linear.bias
        layer.to_empty(device=linear.weight.device)  # torchtune's own: materialises lora_a and lora_b only
        layer.lora_a.to(linear.weight.dtype)  # nn.Module.to casts in place
        layer.lora_b.to(linear.weight.dtype)
        with torch.no_grad():
            layer.initialize_parameters()  # type: ignore[operator]  # layer_type is torchtune's LoRALinear (untyped)
        return layer

    def disabled_adapters(self, model):
        """torchtune's own ``disable_adapter(model)`` context (its DPO recipes' reference model): every LoRA module's
        ``disabled`` set for the block and cleared after it."""
        return require_module(self.name, self.library, when="use").disable_adapter(model)

    def adapters_of(self, layer):
        return layer.lora_a.weight, layer.lora_b.weight

    def rank_alpha(self, layer):
        return layer.rank, layer.alpha

    def inactive(self, layer):
        merged = getattr(layer, "merged", False)
        return f"disabled={layer.disabled} merged={merged}" if layer.disabled or merged else None
