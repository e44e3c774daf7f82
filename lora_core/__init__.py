"""lora_core: the LoRA layer under test (CuPy RawKernels + cuBLAS) and the machinery of the test tiers.

``import lora_core`` never imports CuPy: CPU-only machines need not have it.
"""

from lora_core.backend import BACKENDS, CupyUnavailableError, backend_call_counts, resolve_backend
from lora_core.layer import LoRALinear, lora_scale
from lora_core.ops.lora_linear import lora_linear, lora_linear_torch

__all__ = [
    "BACKENDS", "CupyUnavailableError", "LoRALinear", "backend_call_counts", "lora_linear",
    "lora_linear_torch", "lora_scale", "resolve_backend",
]
