"""The one place where CuPy meets torch: import, streams, dtype codes, cuBLAS, kernel loading.

Layer and op code never call ``cupy.`` directly; they call the helpers here. Everything works on
raw device pointers of torch-allocated tensors, so no copies or host round-trips happen and
torch's memory statistics stay true (CuPy's own pool is never used by this module).

Facts relied on (checked on the lent H200 with cupy 14.2, see ``shared/GPU_NOTES.md``):
- ``cupy.cublas.gemm`` is float32/float64 only; the low-level ``gemmEx`` binding takes bf16/fp16.
- cuBLAS is column-major: a row-major (M, K) tensor is a column-major (K, M) matrix with ld = K.
- Every launch must go on torch's *current* stream, or it races with torch's own work.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

import numpy as np
import torch

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"

INSTALL_HINT = (
    "install CuPy for your CUDA version: pip install 'lora-gpu-suite[cuda12]' (cupy-cuda12x) "
    "or 'lora-gpu-suite[cuda13]' (cupy-cuda13x)"
)


class CupyUnavailableError(RuntimeError):
    """The cupy backend was asked for but cannot run here (no CuPy, or no GPU)."""


@functools.lru_cache(maxsize=1)
def _import_cupy():
    """Import cupy and its cuBLAS binding once; raise CupyUnavailableError saying what is missing."""
    try:
        cupy = importlib.import_module("cupy")
    except ImportError as exc:
        raise CupyUnavailableError(f"the cupy backend needs CuPy, which does not import ({exc}); {INSTALL_HINT}") from exc
    try:
        cublas = importlib.import_module("cupy_backends.cuda.libs.cublas")
    except ImportError as exc:
        raise CupyUnavailableError(f"CuPy imports but its cuBLAS binding does not ({exc}); {INSTALL_HINT}") from exc
    return cupy, cublas


def cupy_available() -> bool:
    """True when CuPy and its cuBLAS binding import (says nothing about a GPU)."""
    try:
        _import_cupy()
    except CupyUnavailableError:
        return False
    return True


def require_cupy():
    """Return (cupy, cublas) or raise CupyUnavailableError naming what is missing."""
    if not torch.cuda.is_available():
        raise CupyUnavailableError(
            "the cupy backend needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use backend='torch' on this machine"
        )
    return _import_cupy()


def cupy_version() -> str | None:
    try:
        cupy, _ = _import_cupy()
    except CupyUnavailableError:
        return None
    return cupy.__version__


# ---------------------------------------------------------------------------------------------
# dtypes
# cudaDataType codes (library_types.h): CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14.
_CUDA_DATA_TYPE = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}
_CUBLAS_COMPUTE_32F = 68  # cublasComputeType_t: fp32 accumulate, no TF32 (matches torch's default)
_CUBLAS_GEMM_DEFAULT = -1
_OP_N, _OP_T = 0, 1
# C++ spelling of each dtype, for kernel template instantiation.
CUDA_TYPE_NAME = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}


# ---------------------------------------------------------------------------------------------
# streams
_stream_cache: dict[tuple[int, int], object] = {}


def current_stream(device: torch.device):
    """The CuPy view of torch's current stream on ``device`` (cached per raw stream handle)."""
    cupy, _ = require_cupy()
    ts = torch.cuda.current_stream(device)
    key = (ts.device_index, ts.cuda_stream)
    stream = _stream_cache.get(key)
    if stream is None:
        if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14: the CUDA stream protocol
            stream = cupy.cuda.Stream.from_external(ts)
        else:  # CuPy 13 (cupy-cuda12x): the same external stream under its older name
            stream = cupy.cuda.ExternalStream(ts.cuda_stream, ts.device_index)
        _stream_cache[key] = stream
    return stream


# ---------------------------------------------------------------------------------------------
# cuBLAS
def gemm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, trans_a: bool = False,
         trans_b: bool = False, alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
    """``out = alpha * op(a) @ op(b) + beta * out`` on row-major contiguous 2-D tensors, via cuBLAS gemmEx.

    op(t) is t or tᵀ. ``a`` and ``b`` share one dtype (fp32, fp16 or bf16); ``out`` has that dtype or
    fp32 (cuBLAS accumulates in fp32 either way: CUBLAS_COMPUTE_32F). Runs on torch's current stream.

    Row-major to column-major: cuBLAS sees each row-major tensor t as tᵀ, so we ask it for
    outᵀ = op(b)ᵀ · op(a)ᵀ, i.e. its "A" is our b and its "B" is our a, with the same transposes.
    """
    _, cublas = require_cupy()
    m_rows, k = (a.shape[1], a.shape[0]) if trans_a else (a.shape[0], a.shape[1])
    k_b, n_cols = (b.shape[1], b.shape[0]) if trans_b else (b.shape[0], b.shape[1])
    assert k == k_b and tuple(out.shape) == (m_rows, n_cols), (a.shape, b.shape, out.shape, trans_a, trans_b)
    assert a.is_contiguous() and b.is_contiguous() and out.is_contiguous()
    assert a.dtype == b.dtype and out.dtype in (a.dtype, torch.float32), (a.dtype, b.dtype, out.dtype)
    if m_rows == 0 or n_cols == 0:
        return out
    if k == 0:  # an empty inner product: out = beta * out, without asking cuBLAS about k = 0
        return out.mul_(beta)
    handle = cublas_handle(out.device)
    cublas.setStream(handle, torch.cuda.current_stream(out.device).cuda_stream)
    alpha_h = np.array(alpha, dtype=np.float32)  # host pointer mode: read before gemmEx returns
    beta_h = np.array(beta, dtype=np.float32)
    in_type, out_type = _CUDA_DATA_TYPE[a.dtype], _CUDA_DATA_TYPE[out.dtype]
    cublas.gemmEx(
        handle, _OP_T if trans_b else _OP_N, _OP_T if trans_a else _OP_N,
        n_cols, m_rows, k,
        alpha_h.ctypes.data, b.data_ptr(), in_type, b.shape[1],
        a.data_ptr(), in_type, a.shape[1],
        beta_h.ctypes.data, out.data_ptr(), out_type, n_cols,
        _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT,
    )
    return out


def cublas_handle(device: torch.device) -> int:
    """CuPy's cuBLAS handle for ``device`` (one per device, created by CuPy on first use)."""
    cupy, _ = require_cupy()
    with cupy.cuda.Device(device.index):
        return cupy.cuda.device.get_cublas_handle()


# ---------------------------------------------------------------------------------------------
# RawKernels
@functools.lru_cache(maxsize=None)
def kernel_module(source_name: str, name_expressions: tuple[str, ...]):
    """Compile ``kernels/<source_name>`` once per process (CuPy also caches the binary on disk)."""
    cupy, _ = require_cupy()
    code = (KERNEL_DIR / source_name).read_text()
    return cupy.RawModule(code=code, options=("-std=c++17",), name_expressions=list(name_expressions))


def launch(source_name: str, name_expressions: tuple[str, ...], kernel_name: str,
           grid: tuple[int, ...], block: tuple[int, ...], args: tuple, device: torch.device) -> None:
    """Launch ``kernel_name`` from ``kernels/<source_name>`` on torch's current stream of ``device``.

    Tensors in ``args`` are passed as raw device pointers; Python ints as 64-bit integers and floats
    as fp32. CuPy raises on a failed launch; a later fault surfaces at the next synchronising call.
    """
    cupy, _ = require_cupy()
    kernel = kernel_module(source_name, name_expressions).get_function(kernel_name)
    packed = tuple(_pack(arg) for arg in args)
    with cupy.cuda.Device(device.index), current_stream(device):
        kernel(grid, block, packed)


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
