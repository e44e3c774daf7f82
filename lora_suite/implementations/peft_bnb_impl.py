"""PEFT's LoRA on a bitsandbytes NF4 base: QLoRA as people run it (``BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=<base dtype>)`` + PEFT).

How it is put in: every ``nn.Linear`` but the LM head becomes a ``bitsandbytes.nn.Linear4bit`` (nf4, block 64,
double quant, compute in the base's dtype) holding the original weight quantised by bitsandbytes, as
transformers does when it loads a model in 4 bits; the model is marked ``is_loaded_in_4bit`` as transformers
marks it, which is what makes PEFT dispatch its own ``peft.tuners.lora.bnb.Linear4bit`` layer; then PEFT's
adapters go on the targets exactly as for ``peft`` (``PeftImplementation``).

Its base is always NF4: a tier that asks for a 16-bit base (``lora.quantize`` null) is refused, naming the key
(``bf16_base`` not applicable), never run on another base silently. ``served_by`` says ``peft-bnb`` only when
every adapted layer is PEFT's bitsandbytes layer over a quantised ``Linear4bit`` that has run.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from lora_core.inject import replace_module, target_linears  # lora_core's meaning of a target
from lora_suite.implementations import AdapterSpec, ImplementationError, PeftImplementation, require_module


class PeftBnbImplementation(PeftImplementation):
    name = expected_path = "peft-bnb"
    not_applicable = {
        "bf16_base": "QLoRA as people run it: the base is always bitsandbytes NF4 (set lora.quantize: nf4)",
        "op_call_count": "PEFT's layers keep no call counter; served_by() checks the layer types instead",
        "lora_core_ops": "these tests call lora_core's cupy op and kernels directly, which PEFT does not use",
    }

    def __init__(self):
        require_module(self.name, "bitsandbytes")
        require_module(self.name, "peft")

    def describe(self) -> str:
        import bitsandbytes
        import peft

        return (
            f"peft-bnb: PEFT {peft.__version__} LoRA on bitsandbytes {bitsandbytes.__version__} Linear4bit "
            f"(nf4, block 64, double quant)"
        )

    def inject(self, model, spec: AdapterSpec):
        if spec.quantize != "nf4":
            raise ImplementationError(f"peft-bnb: quantize={spec.quantize!r}: {self.not_applicable['bf16_base']}")
        self.quantize_base(model)
        model.is_loaded_in_4bit = True  # as transformers marks a 4-bit model: PEFT then wraps with its bnb layer
        return super().inject(model, dataclasses.replace(spec, quantize=None))

    def quantize_base(self, model) -> bool:
        """Every ``nn.Linear`` but the LM head becomes a bitsandbytes ``Linear4bit`` quantised by bitsandbytes (a
        linear that already is one is kept with its codes). lora_core reads these layers without re-quantising
        (``lora_core.bnb_format.from_bnb``), so a reference built over them has the same dequantised weights."""
        import bitsandbytes as bnb

        for path, linear in target_linears(model, ("all-linear",)):
            if isinstance(linear, bnb.nn.Linear4bit):
                continue
            base = linear.weight
            layer = bnb.nn.Linear4bit(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                compute_dtype=base.dtype,
                compress_statistics=True,
                quant_type="nf4",
                device="meta",
            )
            layer.weight = bnb.nn.Params4bit(
                base.data, requires_grad=False, compress_statistics=True, quant_type="nf4", blocksize=64
            ).to(base.device)  # quantises here
            if linear.bias is not None:
                layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
            replace_module(model, path, layer)
        return True

    def wrong_layer(self, m):
        """Not PEFT's bitsandbytes layer, or over a base that is not a quantised ``Linear4bit``."""
        import bitsandbytes as bnb
        from peft.tuners.lora.bnb import Linear4bit as PeftLinear4bit

        if not isinstance(m, PeftLinear4bit):
            return f"{type(m).__module__}.{type(m).__name__} (not PEFT's bitsandbytes layer)"
        if not isinstance(m.base_layer, bnb.nn.Linear4bit) or not m.base_layer.weight.bnb_quantized:
            return "peft-bnb over a base that is not a quantised Linear4bit"
        return None
