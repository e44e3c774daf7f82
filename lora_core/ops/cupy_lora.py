"""The LoRA products on cuBLAS and CuPy RawKernels, as plain functions over 2-D tensors.

Both doors into the cupy path call these: the autograd Function (``lora_linear.CupyLoRALinear``, eager)
and the CUDA implementation of the registered op (``registered``, for ``torch.compile``). Nothing here
refuses stream capture: GEMMs go through ``cupy_interop`` on torch's cuBLAS handle, launches on torch's
stream, and every buffer comes from torch's allocator.

Math (s = scale, W frozen, so no dW; x (N, K), W (O, K), A (r, K), B (O, r)):
    h  = x Aᵀ                      (N, r)
    y  = x Wᵀ + s·h Bᵀ             (N, O)
    dH = dY B                      (N, r)   computed once, used by dA and dx
    dB = s·dYᵀ h                   (O, r)
    dA = s·dHᵀ x                   (r, K)
    dx = dY W + s·dH A             (N, K)

GEMM plan: forward 3 (x Aᵀ; s·h Bᵀ written into y with alpha = s, beta = 0; then x Wᵀ accumulated
into y with beta = 1), backward 5 (dH; dB with alpha = s; dA with alpha = s; s·dH A written into dx
with beta = 0; then dY W accumulated into dx with beta = 1); 3 when x needs no grad (dH, dB, dA).
x and h are saved; x Aᵀ is never recomputed; s is always folded into a GEMM's alpha, so no elementwise
scale or add pass touches (N, O) or (N, K) data.

Why the rank-r term goes first: the (N, O) output y (and the (N, K) dx) must be read once and written
once more to add the second product. A rank-r GEMM (inner dimension r = 8..64) is bandwidth-bound, so a
read-modify-write of y there costs a full extra pass over y (0.18 ms of 1.80 ms at 8192×4096→11008 on an
H100, reports/20261122T081005Z-bench); the base GEMM (inner dimension K in the thousands) is compute-bound,
so reading y as its C operand in the epilogue overlaps the main loop. Writing the rank-r term first with
beta = 0 leaves it a write-only pass. Rounding: the intermediate bf16 rounding now falls on the small
rank-r term instead of the large base term, so the result is no less accurate.
The only RawKernel launches are the fp32 -> 16-bit adapter casts (one launch casts A and B together).
"""

from __future__ import annotations

import torch

from lora_core.ops import cupy_interop as cx
from lora_core.ops import kernel_variants as kv

_CAST_KERNELS = tuple(f"cast_pair_from_f32<{cx.CUDA_TYPE_NAME[d]}>" for d in (torch.bfloat16, torch.float16))
_CAST_BLOCK = 256
_CAST_MAX_GRID = 4096  # the kernel is grid-stride; more blocks than this buys nothing for r×K adapters


def adapters_in(
    cu: cx.on_torch_stream, lora_a: torch.Tensor, lora_b: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B in ``dtype``, contiguous: themselves when they already are, else one cast.cu launch for both.

    The casts land in one buffer (A's r·K values, then B's O·r), so the pair costs one launch.
    """
    if lora_a.dtype == dtype:
        return lora_a.contiguous(), lora_b.contiguous()
    assert lora_a.dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16), (lora_a.dtype, dtype)
    a, b = lora_a.detach().contiguous(), lora_b.detach().contiguous()
    n_a, n_b = a.numel(), b.numel()
    out = torch.empty(n_a + n_b, dtype=dtype, device=a.device)
    grid = (min(cx.ceil_div(n_a + n_b, _CAST_BLOCK), _CAST_MAX_GRID),)
    kv.note("cast_pair_from_f32", dtype, kv.passes(n_a + n_b, grid[0], _CAST_BLOCK), grid, (_CAST_BLOCK,))
    cu.launch(
        "cast.cu",
        _CAST_KERNELS,
        f"cast_pair_from_f32<{cx.CUDA_TYPE_NAME[dtype]}>",
        grid,
        (_CAST_BLOCK,),
        (a, b, out, n_a, n_b),
    )
    return out[:n_a].view(a.shape), out[n_a:].view(b.shape)


def forward(
    cu: cx.on_torch_stream, x2: torch.Tensor, w: torch.Tensor, a_c: torch.Tensor, b_c: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): y = x Wᵀ + s·h Bᵀ (N, O) and h = x Aᵀ (N, r); all inputs 2-D, contiguous, in x's dtype."""
    n, r, out_features = x2.shape[0], a_c.shape[0], w.shape[0]
    h = torch.empty((n, r), dtype=x2.dtype, device=x2.device)
    y = torch.empty((n, out_features), dtype=x2.dtype, device=x2.device)
    cu.gemm(h, x2, a_c, trans_b=True)
    cu.gemm(y, h, b_c, trans_b=True, alpha=scale)
    cu.gemm(y, x2, w, trans_b=True, beta=1.0)
    return y, h


def backward(
    cu: cx.on_torch_stream,
    dy2: torch.Tensor,
    x2: torch.Tensor,
    w,
    a_c: torch.Tensor,
    b_c: torch.Tensor,
    h: torch.Tensor,
    scale: float,
    *,
    need_x: bool,
    need_a: bool,
    need_b: bool,
    adapter_dtype: torch.dtype,
):
    """(dx, dA, dB) for the forward above, each None when not needed; dA, dB in ``adapter_dtype``.

    ``w`` is the (O, K) weight in dy's dtype, or a callable returning it (an NF4 base dequantises into
    scratch only when dx is needed).
    """
    n, in_features = x2.shape
    out_features, r = b_c.shape
    dx = da = db = dh = None
    if need_x or need_a:
        dh = torch.empty((n, r), dtype=dy2.dtype, device=dy2.device)  # (N, r) act
        cu.gemm(dh, dy2, b_c)
    if need_b:
        db = torch.empty((out_features, r), dtype=adapter_dtype, device=dy2.device)  # (O, r) adapter
        cu.gemm(db, dy2, h, trans_a=True, alpha=scale)
    if need_a:
        assert dh is not None  # made above whenever need_a or need_x
        da = torch.empty((r, in_features), dtype=adapter_dtype, device=dy2.device)  # (r, K) adapter
        cu.gemm(da, dh, x2, trans_a=True, alpha=scale)
    if need_x:
        assert dh is not None
        w = w() if callable(w) else w
        dx = torch.empty((n, in_features), dtype=dy2.dtype, device=dy2.device)  # (N, K) act
        cu.gemm(dx, dh, a_c, alpha=scale)
        cu.gemm(dx, dy2, w, beta=1.0)
    return dx, da, db
