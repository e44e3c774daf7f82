"""Which exceptions are CUDA errors: after one the CUDA context cannot be trusted, so a run stops instead of
cascading (the plugin ends the session; a benchmark rotation does not count it as a peer's finding)."""

from __future__ import annotations

import re

_CUDA_ERROR = re.compile(
    r"CUDA error|illegal memory access|device-side assert|CUBLAS_STATUS|CUDARuntimeError|CUDADriverError|"
    r"unspecified launch failure|misaligned address",
    re.IGNORECASE,
)


def is_cuda_error(exc: BaseException) -> bool:
    """Whether ``exc`` comes from a CUDA error, after which the context cannot be trusted (stop, do not go on)."""
    return bool(_CUDA_ERROR.search(f"{type(exc).__name__}: {exc}"))


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error (torch's ``OutOfMemoryError``, CuPy's, or one that says so): a
    verdict on the settings, after which the context is still sound (``lora_suite.harness.oom_verdict``)."""
    return "outofmemory" in type(exc).__name__.lower() or "out of memory" in str(exc).lower()
