"""lora_core: the system under test, a LoRA layer on CuPy RawKernels + cuBLAS with NF4 bases; the harness
that judges it is the sibling package ``lora_suite``, which this package never imports.

``import lora_core`` never imports CuPy (CPU-only machines need not have it), nor torch until an attribute is used.
"""

import importlib

# Attributes load on first use (PEP 562), so that ``import lora_core.targets`` (the config loader, the command line)
# does not import torch; ``from lora_core import LoRALinear`` works as before.
_EXPORTS = {
    "load_peft_adapter": "lora_core.adapters",
    "merge_lora": "lora_core.adapters",
    "save_peft_adapter": "lora_core.adapters",
    "BACKENDS": "lora_core.backend",
    "CupyUnavailableError": "lora_core.backend",
    "backend_call_counts": "lora_core.backend",
    "resolve_backend": "lora_core.backend",
    "LoRAExperts": "lora_core.experts",
    "FUSABLE": "lora_core.fuse",
    "FuseError": "lora_core.fuse",
    "fuse_lora": "lora_core.fuse",
    "inject_lora": "lora_core.inject",
    "LoRALinear": "lora_core.layer",
    "NF4Linear": "lora_core.layer",
    "lora_scale": "lora_core.layer",
    "NF4Tensor": "lora_core.nf4",
    "dequantize_nf4": "lora_core.nf4",
    "quantize_nf4": "lora_core.nf4",
    "lora_linear": "lora_core.ops.lora_linear",
    "lora_linear_torch": "lora_core.ops.lora_linear",
    "nf4_linear": "lora_core.ops.lora_linear",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lora_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = list(_EXPORTS)
