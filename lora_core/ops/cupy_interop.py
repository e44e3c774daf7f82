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


_ready: tuple | None = None  # (cupy, cublas) once a GPU and CuPy were both found


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
class _RawStream:
    """A raw ``cudaStream_t`` exposed through the CUDA stream protocol (for ``Stream.from_external``)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


_stream_cache: dict[tuple[int, int], object] = {}
_device_cache: dict[int, object] = {}


def current_stream(device_index: int):
    """The CuPy view of torch's current stream on ``device_index`` (cached per raw stream handle)."""
    cupy, _ = require_cupy()
    ptr = torch.cuda.current_stream(device_index).cuda_stream
    key = (device_index, ptr)
    stream = _stream_cache.get(key)
    if stream is None:
        if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14: the CUDA stream protocol
            stream = cupy.cuda.Stream.from_external(_RawStream(ptr))
        else:  # CuPy 13 (cupy-cuda12x): the same external stream under its older name
            stream = cupy.cuda.ExternalStream(ptr, device_index)
        _stream_cache[key] = stream
    return stream


class on_torch_stream:
    """Context: CuPy's current device and stream are torch's, for every launch and cuBLAS call inside.

    CuPy's cuBLAS wrappers set the handle's stream to *CuPy's* current stream on each call, so making
    torch's current stream CuPy's current one is what puts the GEMMs on it (without this, GEMMs on a
    torch side stream raced with its producer: tiers/quick/test_layer_parity.py checks it). Enter once
    per forward or backward, not per GEMM: it is the main per-call host cost.

        with on_torch_stream(x.device) as cu:
            cu.gemm(out, a, b, trans_b=True)
    """

    def __init__(self, device: torch.device):
        self.cupy, self.cublas = require_cupy()
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        dev = _device_cache.get(self.index)
        if dev is None:
            dev = _device_cache[self.index] = self.cupy.cuda.Device(self.index)
        self._device_ctx = dev
        self._stream_ctx = None

    def __enter__(self) -> "on_torch_stream":
        self._device_ctx.__enter__()
        self._stream_ctx = current_stream(self.index)
        self._stream_ctx.__enter__()
        self.handle = self.cupy.cuda.device.get_cublas_handle()
        return self

    def __exit__(self, *exc) -> None:
        self._stream_ctx.__exit__(*exc)
        self._device_ctx.__exit__(*exc)

    def gemm(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, trans_a: bool = False,
             trans_b: bool = False, alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
        """``out = alpha * op(a) @ op(b) + beta * out`` on row-major contiguous 2-D tensors (cuBLAS gemmEx).

        op(t) is t or tᵀ. ``a`` and ``b`` share one dtype (fp32, fp16 or bf16); ``out`` has that dtype or
        fp32 (cuBLAS accumulates in fp32 either way: CUBLAS_COMPUTE_32F, no TF32).

        Row-major to column-major: cuBLAS sees each row-major tensor t as tᵀ, so we ask it for
        outᵀ = op(b)ᵀ · op(a)ᵀ, i.e. its "A" is our b and its "B" is our a, with the same transposes.
        """
        m_rows, k = (a.shape[1], a.shape[0]) if trans_a else (a.shape[0], a.shape[1])
        k_b, n_cols = (b.shape[1], b.shape[0]) if trans_b else (b.shape[0], b.shape[1])
        assert k == k_b and tuple(out.shape) == (m_rows, n_cols), (a.shape, b.shape, out.shape, trans_a, trans_b)
        assert a.is_contiguous() and b.is_contiguous() and out.is_contiguous()
        assert a.dtype == b.dtype and out.dtype in (a.dtype, torch.float32), (a.dtype, b.dtype, out.dtype)
        if m_rows == 0 or n_cols == 0:
            return out
        if k == 0:  # an empty inner product: out = beta * out, without asking cuBLAS about k = 0
            return out.zero_() if beta == 0 else out.mul_(beta)
        in_type, out_type = _CUDA_DATA_TYPE[a.dtype], _CUDA_DATA_TYPE[out.dtype]
        self.cublas.gemmEx(
            self.handle, _OP_T if trans_b else _OP_N, _OP_T if trans_a else _OP_N,
            n_cols, m_rows, k,
            _host_scalar(alpha), b.data_ptr(), in_type, b.shape[1],
            a.data_ptr(), in_type, a.shape[1],
            _host_scalar(beta), out.data_ptr(), out_type, n_cols,
            _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT,
        )
        return out

    def launch(self, source_name: str, name_expressions: tuple[str, ...], kernel_name: str,
               grid: tuple[int, ...], block: tuple[int, ...], args: tuple) -> None:
        """Launch ``kernel_name`` from ``kernels/<source_name>`` (compiled once) on torch's stream.

        Tensors in ``args`` are passed as raw device pointers; Python ints as 64-bit integers and floats
        as fp32. CuPy raises on a failed launch; a later fault surfaces at the next synchronising call.
        """
        kernel = kernel_module(source_name, name_expressions).get_function(kernel_name)
        kernel(grid, block, tuple(_pack(arg) for arg in args))


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
@functools.lru_cache(maxsize=None)
def kernel_module(source_name: str, name_expressions: tuple[str, ...]):
    """Compile ``kernels/<source_name>`` once per process (CuPy also caches the binary on disk)."""
    cupy, _ = require_cupy()
    code = (KERNEL_DIR / source_name).read_text()
    return cupy.RawModule(code=code, options=("-std=c++17",), name_expressions=list(name_expressions))


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
