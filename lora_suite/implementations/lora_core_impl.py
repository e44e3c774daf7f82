"""The built-ins ``cupy`` and ``torch``: this project's own layer (``lora_core``) on one of its backends."""

from __future__ import annotations

from lora_suite.implementations.contract import LoRAImplementation


class LoraCoreImplementation(LoRAImplementation):
    """This project's ``lora_core.LoRALinear`` on one backend (``cupy``: the system under test; ``torch``)."""

    inject_per_layer = True

    def __init__(self, backend: str):
        self.name = self.expected_path = backend
        self.not_applicable = {}

    def describe(self) -> str:
        which = "CuPy RawKernels + cuBLAS" if self.name == "cupy" else "torch reference ops"
        return f"{self.name}: lora_core.LoRALinear on the {self.name} backend ({which})"

    def inject(self, model, spec):
        from lora_core.inject import inject_lora

        return inject_lora(
            model,
            spec.targets,
            spec.r,
            spec.alpha,
            backend=self.name,
            use_rslora=spec.use_rslora,
            adapter_dtype=spec.adapter_dtype,
            quantize=spec.quantize,
        )

    def adapter_parameters(self, model):
        from lora_core.inject import adapter_parameters

        return adapter_parameters(model)

    def save_adapter(self, model, path):
        from lora_core.adapters import save_peft_adapter

        return save_peft_adapter(model, path)

    def load_adapter(self, model, path):
        from lora_core.adapters import load_peft_adapter

        load_peft_adapter(model, path)

    def served_by(self, model):
        from lora_core.inject import lora_modules

        return ",".join(sorted({str(m.last_backend) for m in lora_modules(model).values()}))

    def op_calls(self):
        import lora_core

        return lora_core.backend_call_counts()[self.name]
