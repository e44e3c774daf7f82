"""``axolotl``: PEFT's LoRA layers driven by Axolotl's kernels (``axolotl.kernels.lora``), applied the way its
``lora_mlp_kernel`` / ``lora_qkv_kernel`` / ``lora_o_kernel`` flags apply them: each decoder layer's MLP forward
becomes ``apply_lora_mlp_swiglu`` (its LoRA_MLP Function with a Triton SwiGLU; ``apply_lora_mlp_geglu`` for a GELU
MLP, as its patcher chooses: ``axolotl_mlp_kernel``), q/k/v come from one
``apply_lora_qkv`` call per input, and o_proj from ``apply_lora_o`` (``lora_suite.implementations.fused_lora``).
Installed with ``pip install --no-deps axolotl`` plus triton and bitsandbytes, which its kernel module imports.

``served_by`` says ``axolotl`` only when every adapted layer ran through its kernels.
"""

from __future__ import annotations

from lora_suite.implementations.contract import ImplementationError, library_version, require_module
from lora_suite.implementations.fused_lora import fused_served_by, install_fused_lora
from lora_suite.implementations.peft_bnb_impl import BnbBase
from lora_suite.implementations.peft_impl import PeftImplementation

LIBRARIES = ("peft", "axolotl", "triton", "bitsandbytes")
INSTALL = "pip install peft triton bitsandbytes and pip install --no-deps axolotl"
INSTALL_KERNELS = "pip install --no-deps axolotl, with triton and bitsandbytes (what axolotl.kernels.lora imports)"


def axolotl_mlp_kernel(activation: str) -> str:
    """The MLP kernel Axolotl's patcher (``axolotl.monkeypatch.lora_kernels``, 0.21) runs for ``activation``: any
    name holding "gelu" (Gemma's ``gelu_pytorch_tanh`` too) its GeGLU kernel, whose GELU is the erf form; "silu" its
    SwiGLU; nothing else (its patcher refuses it)."""
    if "gelu" in activation:
        return "apply_lora_mlp_geglu"
    if activation == "silu":
        return "apply_lora_mlp_swiglu"
    raise ImplementationError(f"axolotl: MLP activation {activation!r}: Axolotl's kernels have SwiGLU and GeGLU only")


_KERNEL_INPUTS = "Axolotl's fused LoRA kernels (axolotl.kernels.lora) take the base weight and bias, A, B and s"


class AxolotlImplementation(BnbBase, PeftImplementation):
    name = expected_path = "axolotl"
    not_applicable = dict(PeftImplementation.not_applicable)

    def __init__(self):
        require_module(self.name, *LIBRARIES, hint=INSTALL, when="found")
        self._declare_base()  # Axolotl's kernels dequantise bitsandbytes 4-bit bases themselves (QLoRA)
        self.not_applicable = dict(
            self.not_applicable,
            inputs_2d="Axolotl's SwiGLU kernel unpacks (batch, seq_len, hidden) from its input (an H100 run at "
            "a988569: 'not enough values to unpack (expected 3, got 2)'); 2-D cases run as (1, tokens, features)",
            autocast_fp32_inputs="Axolotl's LoRA Functions multiply fp32 activations by 16-bit weights without "
            "autocast's cast (an H100 run at 9ea3c11: 'self and mat2 must have the same dtype, but got BFloat16 and "
            "Float')",
            lora_bias=_KERNEL_INPUTS + "; a bias on B is left out of them",
            dora=_KERNEL_INPUTS + "; Axolotl's config refuses its LoRA kernels with DoRA (peft_use_dora)",
        )

    def describe(self) -> str:
        return f"axolotl: PEFT layers driven by Axolotl {library_version('axolotl')}'s LoRA MLP/QKV/O kernels"

    def inject(self, model, spec):
        kernels = require_module(self.name, "axolotl.kernels.lora", hint=INSTALL_KERNELS, when="use")
        adapted = super().inject(model, self._bnb_spec(model, spec))
        install_fused_lora(model, kernels, mlp_kernel=axolotl_mlp_kernel)
        return adapted

    def served_by(self, model):
        return fused_served_by(self, model)
