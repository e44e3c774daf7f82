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
    """Whether ``exc`` comes from a CUDA error, after which the context cannot be trusted (stop, do not go on). A
    failed assertion or check, or pytest's own error (a fixture not found, a skip), is never one, whatever its text
    quotes (a test whose id names "CUDA error" stopped a whole session)."""
    pytest_own = any(c.__module__.split(".")[0] in ("_pytest", "pytest") for c in type(exc).__mro__)
    if isinstance(exc, AssertionError) or pytest_own:
        return False
    return bool(_CUDA_ERROR.search(f"{type(exc).__name__}: {exc}"))


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error (torch's ``OutOfMemoryError``, CuPy's, or one that says so): a
    verdict on the settings, after which the context is still sound (``lora_suite.harness.oom_verdict``)."""
    return "outofmemory" in type(exc).__name__.lower() or "out of memory" in str(exc).lower()
