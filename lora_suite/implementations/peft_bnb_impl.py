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

The other peers over PEFT's layers (axolotl, peft-liger, unsloth) take the same base where bitsandbytes imports
(``BnbBase``). torch and bitsandbytes are imported where a model is adapted, not where the peer is named (the
controlling process of a run spread over workers resolves ``--lora-impl`` and imports no torch).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING, Protocol

from lora_suite.implementations import AdapterSpec, ImplementationError, PeftImplementation, require_module

if TYPE_CHECKING:
    import bitsandbytes
    from torch import nn

NO_BNB = (
    "bitsandbytes does not import here, and this peer's 4-bit base is bitsandbytes' (install lora-gpu-suite[peft-bnb])"
)


def bnb_nf4_linear(linear: nn.Linear) -> bitsandbytes.nn.Linear4bit:
    """A bitsandbytes ``Linear4bit`` over ``linear``: its weight quantised by bitsandbytes on the weight's device
    (nf4, block 64, double quant, compute in the weight's dtype), as transformers quantises when it loads a model in
    4 bits; its bias, if any, kept frozen."""
    import bitsandbytes as bnb
    from torch import nn

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
    codes = bnb.nn.Params4bit(base.data, requires_grad=False, compress_statistics=True, quant_type="nf4", blocksize=64)
    # .to quantises. bitsandbytes bounds the self TypeVar of Params4bit.to to nn.Module; where bitsandbytes is not
    # installed (an optional extra) mypy reads it as Any and the ignore goes unused
    layer.weight = codes.to(base.device)  # type: ignore[misc, unused-ignore]  # bnb binds to()'s self to nn.Module
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    return layer


def quantize_to_bnb(model: nn.Module) -> bool:
    """Every ``nn.Linear`` but the LM head becomes a bitsandbytes ``Linear4bit`` quantised by bitsandbytes (a
    linear that already is one is kept with its codes); True. lora_core reads these layers without re-quantising
    (``lora_core.bnb_format.from_bnb``), so a reference built over them has the same dequantised weights."""
    import bitsandbytes as bnb

    from lora_core.inject import replace_module, target_linears  # lora_core's meaning of a target

    for path, linear in target_linears(model, ("all-linear",)):
        if not isinstance(linear, bnb.nn.Linear4bit):
            replace_module(model, path, bnb_nf4_linear(linear))
    return True


class PeftBnbImplementation(PeftImplementation):
    name = expected_path = "peft-bnb"
    not_applicable = {
        "bf16_base": "QLoRA as people run it: the base is always bitsandbytes NF4 (set lora.quantize: nf4)",
        # PEFT's own reasons, nf4_base aside (this peer's base always is NF4)
        **{feature: why for feature, why in PeftImplementation.not_applicable.items() if feature != "nf4_base"},
    }

    def __init__(self):
        require_module(self.name, "bitsandbytes", "peft")

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
        return quantize_to_bnb(model)

    def wrong_layer(self, m):
        """Not PEFT's bitsandbytes layer, or over a base that is not a quantised ``Linear4bit``."""
        import bitsandbytes as bnb
        from peft.tuners.lora.bnb import Linear4bit as PeftLinear4bit

        if not isinstance(m, PeftLinear4bit):
            return f"{type(m).__module__}.{type(m).__name__} (not PEFT's bitsandbytes layer)"
        base = m.base_layer
        # Linear4bit keeps nn.Linear's weight: Tensor annotation for its Params4bit (unused ignore: no bitsandbytes)
        if not isinstance(base, bnb.nn.Linear4bit) or not base.weight.bnb_quantized:  # type: ignore[attr-defined, unused-ignore]  # bnb: weight typed Tensor
            return "peft-bnb over a base that is not a quantised Linear4bit"
        return None


class _BnbHost(Protocol):
    """What ``BnbBase``'s methods need of the ``LoRAImplementation`` it is mixed into (their self type)."""

    name: str
    not_applicable: dict[str, str]

    def reason_not_applicable(self, feature: str) -> str | None: ...

    def quantize_base(self, model: nn.Module) -> bool: ...


class BnbBase:
    """QLoRA as the other peers over PEFT's layers run it: peft-bnb's bitsandbytes NF4 base (``Linear4bit``,
    quantised layer by layer as the model is built) under PEFT's bitsandbytes LoRA layers, where bitsandbytes
    imports; where it does not, ``nf4_base`` is declared not applicable with that reason, so a tier never runs
    16-bit without saying so."""

    def _declare_base(self: _BnbHost) -> None:
        if importlib.util.find_spec("bitsandbytes") is None:
            self.not_applicable = dict(self.not_applicable, nf4_base=NO_BNB)
        else:
            self.not_applicable = {k: v for k, v in self.not_applicable.items() if k != "nf4_base"}

    def quantize_base(self, model) -> bool:
        return quantize_to_bnb(model)

    def _bnb_spec(self: _BnbHost, model, spec):
        """``spec`` for PEFT's inject: an NF4 request puts bitsandbytes' base in first and marks the model 4-bit, as
        transformers does, so that PEFT wraps its bitsandbytes layer."""
        if spec.quantize is None:
            return spec
        if spec.quantize != "nf4" or self.reason_not_applicable("nf4_base"):
            raise ImplementationError(
                f"{self.name}: quantize={spec.quantize!r}: {self.reason_not_applicable('nf4_base')}"
            )
        self.quantize_base(model)
        model.is_loaded_in_4bit = True
        return dataclasses.replace(spec, quantize=None)
