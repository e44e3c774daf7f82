"""The one place where CuPy and cuBLAS meet torch: imports, streams, dtype codes, GEMMs, kernel loading.

Layer and op code never call ``cupy.`` or cuBLAS directly; they call the helpers here. Everything works on
raw device pointers of torch-allocated tensors, so no copies or host round-trips happen and torch's memory
statistics stay true (CuPy's own pool is never used by this module).

Two libraries, each for what it does:
- **CuPy** compiles and launches the RawKernels (``kernels/*.cu``), on torch's current stream, passed
  explicitly to each launch;
- **cuBLAS** runs the GEMMs through NVIDIA's thin binding ``nvmath.bindings.cublas.gemm_ex``
  (nvmath-python), on *torch's own* cuBLAS handle (``torch.cuda.current_blas_handle()``), which torch binds
  to its current stream and to its cuBLAS workspace. No CuPy cuBLAS wrapper is called anywhere: those set
  the handle's stream on every call and refuse to run while a stream is being captured ("calling cuBLAS API
  during stream capture is currently unsupported"), which would keep the op out of CUDA graphs and
  ``torch.compile(mode="reduce-overhead")``. On torch's handle, the GEMMs also follow torch's math-mode
  settings (TF32 only where ``torch.backends.cuda.matmul.allow_tf32`` allows it, as for ``F.linear``).

Facts relied on (checked on an H100 and an H200 with torch 2.11 and CuPy 14.2):
- cuBLAS is column-major: a row-major (M, K) tensor is a column-major (K, M) matrix with ld = K.
- Every launch must go on torch's *current* stream, or it races with torch's own work.
- ``gemm_ex`` on torch's handle captures into a CUDA graph, and replay is bitwise equal to eager.
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"

INSTALL_HINT = (
    "install the CUDA extra for your CUDA version: pip install 'lora-gpu-suite[cuda12]' (cupy-cuda12x, "
    "nvmath-python[cu12]) or 'lora-gpu-suite[cuda13]' (cupy-cuda13x, nvmath-python[cu13])"
)


class CupyUnavailableError(RuntimeError):
    """The cupy backend was asked for but cannot run here (no CuPy, no cuBLAS binding, or no GPU)."""


@functools.lru_cache(maxsize=1)
def _import_cupy():
    """Import CuPy and the cuBLAS binding once; raise CupyUnavailableError saying what is missing."""
    try:
        cupy = importlib.import_module("cupy")
    except ImportError as exc:
        raise CupyUnavailableError(
            f"the cupy backend needs CuPy, which does not import ({exc}); {INSTALL_HINT}"
        ) from exc
    try:
        cublas = importlib.import_module("nvmath.bindings.cublas")
    except ImportError as exc:
        raise CupyUnavailableError(
            f"the cupy backend calls cuBLAS through nvmath-python's binding, which does not import ({exc}); "
            f"{INSTALL_HINT}"
        ) from exc
    return cupy, cublas


def _constant_for_compile(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing torch._dynamo (3.6 s of every import of
    lora_core on an H200, reports/20261124T063239Z-quick): its whole effect is this attribute, which dynamo reads
    when it traces a call (tests/core/test_backend.py checks that torch's own decorator sets just this)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@_constant_for_compile
def cupy_available() -> bool:
    """True when CuPy and the cuBLAS binding import (says nothing about a GPU).

    A constant for ``torch.compile``: evaluated once while tracing, instead of tracing the imports.
    """
    try:
        _import_cupy()
    except CupyUnavailableError:
        return False
    return True


_ready: tuple | None = None  # (cupy, cublas) once a GPU, CuPy and the binding were all found


def require_cupy():
    """Return (cupy, cublas) or raise CupyUnavailableError naming what is missing."""
    global _ready
    if _ready is not None:
        return _ready
    if not torch.cuda.is_available():
        raise CupyUnavailableError(
            "the cupy backend needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use backend='torch' on this machine"
        )
    _ready = _import_cupy()
    return _ready


def cupy_version() -> str | None:
    try:
        cupy, _ = _import_cupy()
    except CupyUnavailableError:
        return None
    return cupy.__version__


def cublas_binding_version() -> str | None:
    """The version of nvmath-python, whose cuBLAS binding runs the GEMMs (None when it does not import)."""
    try:
        return importlib.import_module("nvmath").__version__
    except ImportError:
        return None


# ---------------------------------------------------------------------------------------------
# dtypes
# cudaDataType codes (library_types.h): CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14.
_CUDA_DATA_TYPE = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}
_CUBLAS_COMPUTE_32F = 68  # cublasComputeType_t: fp32 accumulate (TF32 only if the handle's math mode allows)
_CUBLAS_GEMM_DEFAULT = -1
_OP_N, _OP_T = 0, 1
# C++ spelling of each dtype, for kernel template instantiation.
CUDA_TYPE_NAME = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}


# ---------------------------------------------------------------------------------------------
# streams
class _RawStream:
    """A raw ``cudaStream_t`` in the shape CuPy's kernel launch reads (``.ptr``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class on_torch_stream:
    """Context: cuBLAS calls and kernel launches inside go on torch's current device and stream.

    On entry it takes torch's cuBLAS handle for the current device (torch binds it to the current stream
    and its workspace) and torch's current stream; nothing about CuPy's own current stream or device is
    changed, and nothing here refuses stream capture. When ``device`` is not torch's current device, the
    context makes it current for its duration (handle, stream and kernel module all belong to it).

        with on_torch_stream(x.device) as cu:
            cu.gemm(out, a, b, trans_b=True)
    """

    __slots__ = ("cupy", "cublas", "index", "handle", "stream", "_guard")

    def __init__(self, device: torch.device):
        self.cupy, self.cublas = require_cupy()
        current = torch.cuda.current_device()
        self.index = current if device.index is None else device.index
        self._guard = None if self.index == current else torch.cuda.device(self.index)

    def __enter__(self) -> on_torch_stream:
        if self._guard is not None:
            self._guard.__enter__()
        self.handle = torch.cuda.current_blas_handle()
        # the raw cudaStream_t of torch's current stream, without building a torch.cuda.Stream object (host time);
        # the same call Inductor's generated code makes for its launches
        self.stream = _RawStream(torch._C._cuda_getCurrentRawStream(self.index))
        return self

    def __exit__(self, *exc) -> None:
        if self._guard is not None:
            self._guard.__exit__(*exc)

    def gemm(
        self,
        out: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        trans_a: bool = False,
        trans_b: bool = False,
        alpha: float = 1.0,
        beta: float = 0.0,
    ) -> torch.Tensor:
        """``out = alpha * op(a) @ op(b) + beta * out`` on row-major 2-D tensors (cublasGemmEx).

        op(t) is t or tᵀ. ``a`` and ``b`` share one dtype (fp32, fp16 or bf16); ``out`` has that dtype or
        fp32 (cuBLAS accumulates in fp32 either way: CUBLAS_COMPUTE_32F). Each tensor is contiguous or a
        column slice of a contiguous one (unit stride along its rows, ``t[:, i:j]``): its row stride is the
        leading dimension, so the fused paths write and read the parts of one buffer without copies.

        Row-major to column-major: cuBLAS sees each row-major tensor t as tᵀ, so we ask it for
        outᵀ = op(b)ᵀ · op(a)ᵀ, i.e. its "A" is our b and its "B" is our a, with the same transposes.
        alpha and beta are host scalars (the handle's default pointer mode), read when the call is made,
        so a captured graph keeps the values of capture time.
        """
        m_rows, k = (a.shape[1], a.shape[0]) if trans_a else (a.shape[0], a.shape[1])
        k_b, n_cols = (b.shape[1], b.shape[0]) if trans_b else (b.shape[0], b.shape[1])
        assert k == k_b and tuple(out.shape) == (m_rows, n_cols), (a.shape, b.shape, out.shape, trans_a, trans_b)
        lda, ldb, ldc = _row_stride(a), _row_stride(b), _row_stride(out)
        assert a.dtype == b.dtype and out.dtype in (a.dtype, torch.float32), (a.dtype, b.dtype, out.dtype)
        if m_rows == 0 or n_cols == 0:
            return out
        if k == 0:  # an empty inner product: out = beta * out, without asking cuBLAS about k = 0
            return out.zero_() if beta == 0 else out.mul_(beta)
        in_type, out_type = _CUDA_DATA_TYPE[a.dtype], _CUDA_DATA_TYPE[out.dtype]
        self.cublas.gemm_ex(
            self.handle,
            _OP_T if trans_b else _OP_N,
            _OP_T if trans_a else _OP_N,
            n_cols,
            m_rows,
            k,
            _host_scalar(alpha),
            b.data_ptr(),
            in_type,
            ldb,
            a.data_ptr(),
            in_type,
            lda,
            _host_scalar(beta),
            out.data_ptr(),
            out_type,
            ldc,
            _CUBLAS_COMPUTE_32F,
            _CUBLAS_GEMM_DEFAULT,
        )
        return out

    def launch(
        self,
        source_name: str,
        name_expressions: tuple[str, ...],
        kernel_name: str,
        grid: tuple[int, ...],
        block: tuple[int, ...],
        args: tuple,
    ) -> None:
        """Launch ``kernel_name`` from ``kernels/<source_name>`` (compiled once per device) on torch's stream.

        Tensors in ``args`` are passed as raw device pointers; Python ints as 64-bit integers and floats
        as fp32. CuPy raises on a failed launch; a later fault surfaces at the next synchronising call.
        """
        kernel = _kernel(source_name, name_expressions, kernel_name, self.index)
        kernel(grid, block, tuple(_pack(arg) for arg in args), stream=self.stream)


def _row_stride(t: torch.Tensor) -> int:
    """The leading dimension cuBLAS reads ``t`` with: its row stride, once its rows are unit-stride."""
    rows, cols = t.shape
    if cols > 1 and t.stride(1) != 1 or rows > 1 and t.stride(0) < cols:
        raise ValueError(
            f"gemm operand of shape {tuple(t.shape)} has strides {t.stride()}: expected unit stride along a row "
            "(a contiguous tensor or a column slice of one)"
        )
    return max(t.stride(0), cols, 1) if rows > 1 else max(cols, 1)


_host_scalars: dict[float, tuple[np.ndarray, int]] = {}


def _host_scalar(value: float) -> int:
    """Address of a cached fp32 host scalar (cuBLAS host pointer mode reads it before returning).

    The array and its address are cached together: ``ndarray.ctypes`` costs microseconds per call.
    """
    hit = _host_scalars.get(value)
    if hit is None:
        if len(_host_scalars) > 1024:  # many distinct scales: do not grow without bound
            _host_scalars.clear()
        arr = np.array(value, dtype=np.float32)
        hit = _host_scalars[value] = (arr, arr.ctypes.data)
    return hit[1]


# ---------------------------------------------------------------------------------------------
# RawKernels
@functools.cache
def kernel_module(source_name: str, name_expressions: tuple[str, ...], device_index: int = 0):
    """Compile ``kernels/<source_name>`` once per process and device (CuPy also caches the binary on disk)."""
    cupy, _ = require_cupy()
    code = kernel_source(source_name)
    return cupy.RawModule(code=code, options=("-std=c++17",), name_expressions=list(name_expressions))


_LOCAL_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.cuh)"$', re.M)


def kernel_source(source_name: str) -> str:
    """``kernels/<source_name>`` with each ``#include "x.cuh"`` line replaced by ``kernels/x.cuh`` (once per header):
    the code CuPy compiles, and keys its disk cache on, holds every header, so an edited header recompiles."""
    seen: set[str] = set()

    def paste(match: re.Match[str]) -> str:
        header = match.group(1)
        if header in seen:
            return ""
        seen.add(header)
        return _LOCAL_INCLUDE.sub(paste, (KERNEL_DIR / header).read_text())

    return _LOCAL_INCLUDE.sub(paste, (KERNEL_DIR / source_name).read_text())


KERNEL_LOAD_SECONDS: dict[str, float] = {}  # "<source>:<kernel>" -> seconds its first load took (NVRTC or disk cache)


@functools.cache
def _kernel(source_name: str, name_expressions: tuple[str, ...], kernel_name: str, device_index: int):
    """The launchable function, loaded into ``device_index``'s context (looked up once: saves host time)."""
    cupy, _ = require_cupy()
    start = time.perf_counter()
    with cupy.cuda.Device(device_index):
        fn = kernel_module(source_name, name_expressions, device_index).get_function(kernel_name)
    KERNEL_LOAD_SECONDS[f"{source_name}:{kernel_name}"] = time.perf_counter() - start
    return fn


def _pack(arg):
    if isinstance(arg, torch.Tensor):
        return np.uint64(arg.data_ptr())
    if isinstance(arg, bool):
        return np.int32(arg)
    if isinstance(arg, int):
        return np.int64(arg)
    if isinstance(arg, float):
        return np.float32(arg)
    return arg


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
