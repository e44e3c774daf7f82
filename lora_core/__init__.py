"""lora_core: the system under test, a LoRA layer on CuPy RawKernels + cuBLAS with NF4 bases; the harness
that judges it is the sibling package ``lora_suite``, which this package never imports.

``import lora_core`` never imports CuPy: CPU-only machines need not have it.
"""

from lora_core.adapters import load_peft_adapter, merge_lora, save_peft_adapter
from lora_core.backend import BACKENDS, CupyUnavailableError, backend_call_counts, resolve_backend
from lora_core.fuse import FUSABLE, FuseError, fuse_lora
from lora_core.inject import inject_lora
from lora_core.layer import LoRALinear, NF4Linear, lora_scale
from lora_core.nf4 import NF4Tensor, dequantize_nf4, quantize_nf4
from lora_core.ops.lora_linear import lora_linear, lora_linear_torch, nf4_linear

__all__ = [
    "BACKENDS",
    "CupyUnavailableError",
    "FUSABLE",
    "FuseError",
    "fuse_lora",
    "load_peft_adapter",
    "merge_lora",
    "save_peft_adapter",
    "LoRALinear",
    "NF4Linear",
    "NF4Tensor",
    "backend_call_counts",
    "dequantize_nf4",
    "inject_lora",
    "lora_linear",
    "lora_linear_torch",
    "lora_scale",
    "nf4_linear",
    "quantize_nf4",
    "resolve_backend",
]
