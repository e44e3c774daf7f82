"""Which implementation of the LoRA op runs: ``"cupy"`` (the system under test) or ``"torch"`` (reference).

Resolution is explicit and observable, never a silent fallback:
- an explicit ``backend="cupy"`` that cannot run raises ``CupyUnavailableError`` saying what is missing;
- ``backend=None`` picks ``"cupy"`` for CUDA tensors when CuPy imports, else ``"torch"``; the
  environment variable ``LORA_CORE_BACKEND`` overrides that default. When a CUDA tensor gets the torch
  path because CuPy is missing, a warning says so once per process;
- every call is counted per backend (``backend_call_counts``) so tests and reports can prove which
  path actually ran.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter

import torch

from lora_core.ops.cupy_interop import CupyUnavailableError, cupy_available, require_cupy

BACKENDS = ("cupy", "torch")
ENV_VAR = "LORA_CORE_BACKEND"

_calls: Counter[str] = Counter()
_warned_default = False


def validate_backend_name(backend: str | None) -> str | None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not known; expected one of {BACKENDS} or None (auto)")
    return backend


def default_backend(device: torch.device) -> str:
    """The backend that ``backend=None`` means for tensors on ``device``."""
    global _warned_default
    env = validate_backend_name(os.environ.get(ENV_VAR) or None)
    if env is not None:
        return env
    if device.type != "cuda":
        return "torch"
    if cupy_available():
        return "cupy"
    if not _warned_default:
        warnings.warn(
            "lora_core: CUDA tensors but CuPy does not import, so backend=None runs the torch reference "
            "backend, not the CuPy kernels under test; install lora-gpu-suite[cuda12] or [cuda13]",
            RuntimeWarning,
            stacklevel=3,
        )
        _warned_default = True
    return "torch"


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """Return the backend that will run for tensors on ``device``, or raise saying why it cannot."""
    name = validate_backend_name(backend) or default_backend(device)
    if name == "cupy":
        if not torch.compiler.is_compiling():  # traced: the op's CUDA implementation requires it when it runs
            require_cupy()
        if device.type != "cuda":
            raise ValueError(
                f"backend='cupy' needs CUDA tensors, but the inputs are on {device}; "
                "move them to the GPU or use backend='torch'"
            )
    return name


def count_call(backend: str, layers: int = 1) -> None:
    _calls[backend] += layers


def backend_call_counts() -> dict[str, int]:
    """How many LoRA layer forwards each backend has served in this process: one per layer per forward pass (a
    fused path that serves gate, up and down, or q, k and v, in one call counts its three layers)."""
    return {name: _calls[name] for name in BACKENDS}


__all__ = [
    "BACKENDS",
    "CupyUnavailableError",
    "backend_call_counts",
    "count_call",
    "default_backend",
    "resolve_backend",
    "validate_backend_name",
]
