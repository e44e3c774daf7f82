"""``peft-liger``: PEFT's LoRA layers with Liger-Kernel's fused RMSNorm, RoPE, SwiGLU and fused linear
cross-entropy (``lora_suite.implementations.liger_ops``).

``served_by`` says ``peft-liger`` only when every adapted layer ran PEFT's forward and the model holds Liger's ops.
"""

from __future__ import annotations

from lora_suite.implementations.contract import ImplementationError, library_version, require_module
from lora_suite.implementations.peft_bnb_impl import BnbBase
from lora_suite.implementations.peft_impl import PeftImplementation


class PeftLigerImplementation(BnbBase, PeftImplementation):
    name = expected_path = "peft-liger"
    separate_reference = True  # the architecture checks' float64 reference: in a fresh process (the patches below)
    not_applicable = dict(PeftImplementation.not_applicable)

    def __init__(self):
        require_module(self.name, "peft", "liger_kernel", hint="install lora-gpu-suite[liger]", when="found")
        from lora_suite.implementations.liger_ops import NOT_CAPTURABLE

        self.not_applicable = dict(
            self.not_applicable,
            cuda_graph_capture=NOT_CAPTURABLE,
            float64_reference_model="Liger's RoPE replaces transformers' function for the whole process and its Triton "
            "kernels take no float64, so no float64 copy of a model runs beside it; the LoRA layers peft-liger uses "
            "are PEFT's, judged on every architecture under --lora-impl peft",
        )
        self._declare_base()  # Liger's ops run over PEFT's bitsandbytes layers as over its 16-bit ones

    def describe(self) -> str:
        return f"peft-liger: PEFT layers with Liger-Kernel {library_version('liger-kernel')}'s fused non-LoRA ops"

    def inject(self, model, spec):
        from lora_suite.implementations.liger_ops import FusedOpsError, apply_liger_ops

        require_module(self.name, "liger_kernel.transformers", hint="pip install liger-kernel", when="use")
        adapted = super().inject(model, self._bnb_spec(model, spec))
        if type(model).__name__ == "LlamaForCausalLM":  # the whole model (PEFT injects it whole, not per layer)
            try:
                apply_liger_ops(model)
            except FusedOpsError as exc:
                raise ImplementationError(f"peft-liger: {exc}") from None
        return adapted

    def served_by(self, model):
        from lora_suite.implementations.liger_ops import describe_liger

        peft_path = super().served_by(model)
        if peft_path != "peft-liger":  # PeftImplementation reports its own name when every layer served
            return peft_path
        if type(model).__name__ != "LlamaForCausalLM":  # a layer probe: Liger's ops are a whole Llama's, none here
            return self.expected_path
        liger = describe_liger(model)
        return self.expected_path if liger != "none" else "PEFT layers without Liger's ops"
