"""What the fused LoRA paths run on: the cupy engine (cuBLAS + RawKernels, the system under test) or the torch
engine (the same calls as plain torch ops: the reference the CPU tests run, and ``backend="torch"``).

Both engines take the same calls, so one autograd Function (``fused_mlp``, ``fused_qkv``) holds the whole GEMM
plan, its buffers and its in-place steps, and the CPU tests exercise that plan, not a copy of it:

    gemm(out, a, b, trans_a=, trans_b=, alpha=, beta=)   out = alpha·op(a)·op(b) + beta·out, column slices allowed
    stack_cast(eng, tensors, dtype)                      one buffer holding every tensor in ``dtype``, back to back
    swiglu_forward(eng, gu, activation) -> act           act = f(g)·u           (gu = [g | u], (N, 2I))
    swiglu_backward_(eng, dact, gu, activation)          in place: gu <- [dg | du], dact <- act (recomputed)
    stacked_a_backward(eng, dh, x, a, ...) -> dA, dx     dA = s·dhᵀ x, dx = s·dh A (the adapters' part)
    bias_into_(out, bias, start) -> β                    out <- bias[start:] broadcast; β of the GEMMs that follow

Math of the gated steps (computed in fp32, rounded once to the activation dtype), f the gate activation:
    dg = d · u · f'(g),   du = d · f(g);   SiLU (SwiGLU): f(g) = g σ(g), f'(g) = σ(g) (1 + g (1 - σ(g)));
    the tanh GELU (GeGLU, Gemma): ``activation_parts``.
"""

from __future__ import annotations

import math

import torch

from lora_core.backend import resolve_backend
from lora_core.ops import cupy_interop as cx
from lora_core.ops import kernel_variants as kv
from lora_core.ops.lora_linear import ACTIVATION_DTYPES, REFERENCE_ONLY_DTYPES

_CAST_KERNELS = tuple(f"cast_stack_from_f32<{cx.CUDA_TYPE_NAME[d]}>" for d in (torch.bfloat16, torch.float16))
_SWIGLU_VEC = {torch.float32: 4, torch.bfloat16: 8, torch.float16: 8}  # 16 bytes per vector
_SWIGLU_VARIANTS = [(d, v) for d, w in _SWIGLU_VEC.items() for v in (1, w)]
ACTIVATIONS = {"silu": "swiglu", "gelu_tanh": "geglu"}  # the gate activation -> its kernels' prefix in swiglu.cu
_GATED_NAMES = {
    (act, step): tuple(f"{prefix}_{step}<{cx.CUDA_TYPE_NAME[d]}, {v}>" for d, v in _SWIGLU_VARIANTS)
    for act, prefix in ACTIVATIONS.items()
    for step in ("forward", "backward_inplace")
}
_BLOCK = 256
_MAX_GRID = 8192  # grid-stride kernels: more blocks buy nothing
_MAX_ROWS = 16384  # grid y of the SwiGLU kernels (rows, grid-stride beyond it; the hardware's limit is 65535)


def _swiglu_vec(dtype: torch.dtype, inter: int) -> int:
    """Elements per thread access: a 16-byte vector when I is a multiple of its width (so every row's g and u
    halves start 16-byte aligned and hold whole vectors), else 1 (scalar loads)."""
    return _SWIGLU_VEC[dtype] if inter % _SWIGLU_VEC[dtype] == 0 else 1


def _swiglu_launch(dtype: torch.dtype, n: int, inter: int, kernel: str) -> tuple[str, tuple[int, int]]:
    """The kernel variant and its grid (x across a row's vectors, y over rows), reported to ``kernel_variants``."""
    vec = _swiglu_vec(dtype, inter)
    grid = (min(cx.ceil_div(inter // vec, _BLOCK), 64), min(n, _MAX_ROWS))
    kv.note(kernel, dtype, f"VEC={vec}, {kv.residue(inter, _SWIGLU_VEC[dtype])}", grid, (_BLOCK,))
    return f"{kernel}<{cx.CUDA_TYPE_NAME[dtype]}, {vec}>", grid


class TorchEngine:
    """The torch engine: ``gemm`` with cuBLAS's meaning (fp32 accumulation, fp64 for fp64 inputs)."""

    def __enter__(self) -> TorchEngine:
        return self

    def __exit__(self, *exc) -> None:
        return None

    @staticmethod
    def gemm(out, a, b, *, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
        acc = torch.promote_types(torch.promote_types(a.dtype, out.dtype), torch.float32)
        prod = torch.matmul((a.t() if trans_a else a).to(acc), (b.t() if trans_b else b).to(acc))
        prod = prod.mul_(alpha) if beta == 0 else prod.mul_(alpha).add_(out.to(acc), alpha=beta)
        out.copy_(prod)
        return out


def enter(x: torch.Tensor, backend: str | None) -> tuple[torch.Tensor, str]:
    """(x in the autocast dtype when autocast is on, as ``F.linear`` would run it; the resolved backend)."""
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "the fused LoRA paths are autograd Functions over CuPy and cuBLAS, not registered ops: torch.compile "
            "cannot trace them; capture the training step in a CUDA graph (train.cuda_graph) instead"
        )
    device_type = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device_type):
        x = x.to(torch.get_autocast_dtype(device_type))
    return x, resolve_backend(backend, x.device)


def check_dtypes(x: torch.Tensor, adapters, backend: str) -> None:
    """x in an activation dtype (fp64 on the torch engine only); the adapters all in x's dtype, or fp32 under
    16-bit activations. Each error names the bad value and what was expected."""
    allowed = ACTIVATION_DTYPES + (REFERENCE_ONLY_DTYPES if backend == "torch" else ())
    if x.dtype not in allowed:
        raise ValueError(f"x has dtype {x.dtype}, expected one of {allowed} for backend={backend!r}")
    dtypes = {t.dtype for t in adapters}
    ok = (x.dtype,) + ((torch.float32,) if x.dtype in (torch.float16, torch.bfloat16) else ())
    if len(dtypes) != 1 or not dtypes <= set(ok):
        raise ValueError(f"adapters have dtypes {sorted(map(str, dtypes))}, expected one of {ok} for x {x.dtype}")


def engine(backend: str, device: torch.device):
    """The engine for ``backend`` ("cupy" or "torch"), as a context (the cupy one binds torch's stream)."""
    return cx.on_torch_stream(device) if backend == "cupy" else TorchEngine()


def stack_cast(eng, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """One contiguous 1-D buffer holding ``tensors`` (each flattened) in ``dtype``, back to back.

    On the cupy engine, fp32 sources into a 16-bit dtype take one launch of ``cast_stack_from_f32`` (at most six
    sources); otherwise ``torch.cat`` (a copy in the same dtype is still a copy: the buffer never aliases).
    """
    if isinstance(eng, cx.on_torch_stream) and dtype in (torch.bfloat16, torch.float16):
        if len(tensors) <= 6 and all(t.dtype == torch.float32 for t in tensors):
            srcs = [t.detach().contiguous() for t in tensors]
            ends, total = [], 0
            for t in srcs:
                total += t.numel()
                ends.append(total)
            srcs += [srcs[-1]] * (6 - len(srcs))
            ends += [total] * (6 - len(ends))
            out = torch.empty(total, dtype=dtype, device=srcs[0].device)
            name = f"cast_stack_from_f32<{cx.CUDA_TYPE_NAME[dtype]}>"
            grid = (min(cx.ceil_div(total, _BLOCK), _MAX_GRID),)
            sources = "6 sources" if len(tensors) == 6 else "padded sources"
            kv.note("cast_stack_from_f32", dtype, f"{sources}, {kv.passes(total, grid[0], _BLOCK)}", grid, (_BLOCK,))
            eng.launch("cast.cu", _CAST_KERNELS, name, grid, (_BLOCK,), (*srcs, out, *ends))
            return out
    return torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])


def split_views(buffer: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Contiguous views of ``buffer`` with ``shapes``, in order (the inverse of ``stack_cast``)."""
    views, start = [], 0
    for rows, cols in shapes:
        views.append(buffer[start : start + rows * cols].view(rows, cols))
        start += rows * cols
    return views


def stacked_a_backward(
    eng, dh: torch.Tensor, x2: torch.Tensor, a: torch.Tensor, scale: float, acc_dtype: torch.dtype, need_dx: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backward through h = x Aᵀ for the stacked down-projections of a fused path, A = [A_1; …; A_m] (m·r, K):
    dA = s·dhᵀ x (m·r, K) in ``acc_dtype`` and, when ``need_dx``, the adapters' part of dx, s·dh A (N, K) in dh's
    dtype (else None); the caller adds the frozen bases' part to that dx."""
    da = torch.empty(a.shape, dtype=acc_dtype, device=dh.device)
    eng.gemm(da, dh, x2, trans_a=True, alpha=scale)
    if not need_dx:
        return da, None
    dx = torch.empty(x2.shape, dtype=dh.dtype, device=dh.device)
    eng.gemm(dx, dh, a, alpha=scale)
    return da, dx


def activation_parts(g: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(f(g), f'(g)) of the gate activation (swiglu.cu's Silu and GeluTanh, on torch ops)."""
    if activation == "silu":
        sig = torch.sigmoid(g)
        return g * sig, sig * (1 + g * (1 - sig))
    if activation == "gelu_tanh":
        k0, k1 = math.sqrt(2 / math.pi), 0.044715
        t = torch.tanh(k0 * (g + k1 * g**3))
        return 0.5 * g * (1 + t), 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k0 * (1 + 3 * k1 * g * g)
    raise ValueError(f"activation={activation!r}, expected one of {sorted(ACTIVATIONS)}")


def swiglu_forward(eng, gu: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act (N, I) = f(g)·u for gu = [g | u] (N, 2I), contiguous; f the gate ``activation`` (SiLU: SwiGLU)."""
    n, two_i = gu.shape
    inter = two_i // 2
    act = torch.empty((n, inter), dtype=gu.dtype, device=gu.device)
    if isinstance(eng, cx.on_torch_stream):
        if n * inter:
            kernel = f"{ACTIVATIONS[activation]}_forward"
            name, grid = _swiglu_launch(gu.dtype, n, inter, kernel)
            eng.launch("swiglu.cu", _GATED_NAMES[activation, "forward"], name, grid, (_BLOCK,), (gu, act, n, inter))
        return act
    acc = torch.promote_types(gu.dtype, torch.float32)
    g, u = gu[:, :inter].to(acc), gu[:, inter:].to(acc)
    act.copy_(activation_parts(g, activation)[0] * u)
    return act


def swiglu_backward_(eng, dact: torch.Tensor, gu: torch.Tensor, activation: str = "silu") -> None:
    """In place: gu <- [dg | du] and dact <- act = f(g)·u (recomputed, for the down projection's dA)."""
    n, inter = dact.shape
    if isinstance(eng, cx.on_torch_stream):
        if n * inter:
            kernel = f"{ACTIVATIONS[activation]}_backward_inplace"
            name, grid = _swiglu_launch(gu.dtype, n, inter, kernel)
            names = _GATED_NAMES[activation, "backward_inplace"]
            eng.launch("swiglu.cu", names, name, grid, (_BLOCK,), (dact, gu, n, inter))
        return
    acc = torch.promote_types(gu.dtype, torch.float32)
    g, u, d = gu[:, :inter].to(acc), gu[:, inter:].to(acc), dact.to(acc)
    f, df = activation_parts(g, activation)
    dg, du, act = d * u * df, d * f, f * u  # all read before any is written:
    gu[:, :inter].copy_(dg)  # g, u and d may be views of the buffers written here
    gu[:, inter:].copy_(du)
    dact.copy_(act)


def bias_into_(out: torch.Tensor, bias: torch.Tensor | None, start: int = 0) -> float:
    """A frozen bias b = bias[start : start + O] broadcast into ``out`` (N, O, a column slice allowed), the tensor
    the projection's GEMMs then accumulate into; returns their first β: 1 to keep b, 0 when there is no bias (``out``
    left as it is). The bias adds nothing to a backward (frozen, and ∂out/∂x does not see it)."""
    if bias is None:
        return 0.0
    out.copy_(bias[start : start + out.shape[1]].to(out.dtype).expand_as(out))
    return 1.0
