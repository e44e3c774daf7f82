"""Fused linear cross-entropy: the LM head and the token-mean cross-entropy over chunks of tokens, as one autograd
Function that never holds the (N, V) logits, with static shapes, so a CUDA graph captures the whole training step.

Shapes: h (N, d) the final hidden states, W (V, d) the head, t (N,) the targets (``ignore_index``: no loss),
n = #{i : t_i ≠ ignore_index} (or ``num_items``, transformers' ``num_items_in_batch``, when given):

    z_i   = h_i Wᵀ                                      (V,)   the logits of token i, in h's dtype
    lse_i = m_i + log Σ_j exp(z_ij - m_i),  m_i = max_j z_ij
    loss  = (1/n) Σ_{i: t_i ≠ ignore} (lse_i - z_{i,t_i})                   (fp32; 0/0 = NaN when n = 0)
    dz_ij = (softmax(z_i)_j - [j = t_i]) / n            0 for an ignored row
(with ``softcap`` c, Gemma 2's: z_i = c·tanh(h_i Wᵀ / c), and dz picks up the factor 1 - tanh²(h_i Wᵀ / c))
    dh    = dz W   (N, d),   dW = dzᵀ h   (V, d, fp32 accumulation) when W requires grad

Plan, per chunk c of C rows (the last one shorter; C from ``chunk_rows``):
    z_c  = h_c Wᵀ                      one GEMM into a (C, V) scratch reused by every chunk
    cross_entropy_rows(z_c)            cross_entropy.cu: loss_rows_c, and z_c overwritten by n·dz_c (entries of order 1)
    dh_c = n·dz_c W,  dW += n·dz_cᵀ h_c  two GEMMs (the second only when W requires grad)
The gradient is computed in the forward, as Liger-Kernel's fused linear cross-entropy does: the loss's upstream
gradient g is a scalar, so the backward only scales dh (and dW) by g/n, on the device, in fp32. The 1/n is kept out
of the 16-bit n·dz: dz itself (≈ p/n ~ 10⁻⁸ at V ~ 5·10⁴, n ~ 10³) would fall among fp16's subnormals, which the
quick tier's fp16 grid caught as a dh error of 2·10⁻² of its scale. n is counted on the device (no
host synchronisation anywhere), so a captured replay judges each batch with its own count. A target outside [0, V)
that is not ``ignore_index`` makes its row's loss NaN on the cupy engine (the trainer's non-finite check stops the
run and names the step); the torch engine raises at once.
"""

from __future__ import annotations

import math

import torch

from lora_core.ops import cupy_interop as cx
from lora_core.ops import fused_engine as fe
from lora_core.ops import kernel_variants as kv
from lora_core.ops.lora_linear import ACTIVATION_DTYPES, REFERENCE_ONLY_DTYPES

IGNORE_INDEX = -100  # transformers' and PyTorch's label for "no loss here"
MIN_CHUNK_ROWS = 1024
_BLOCK = 256
_KERNELS = tuple(
    f"cross_entropy_rows<{cx.CUDA_TYPE_NAME[d]}, {v}>" for d in ACTIVATION_DTYPES for v in (1, 16 // d.itemsize)
)


def default_chunk_rows(n: int, vocab: int, hidden: int) -> int:
    """Rows per chunk: Liger-Kernel's rule, which makes a chunk's logits about the size of the hidden states
    (C = next power of 2 ≥ N / ⌈V / d⌉), raised to ``MIN_CHUNK_ROWS`` (a chosen floor, so that a chunk's three GEMMs
    are not a few hundred rows each at small d) and capped at N."""
    per = math.ceil(n / max(1, math.ceil(vocab / max(1, hidden))))
    return max(1, min(n, max(MIN_CHUNK_ROWS, 1 << max(0, per - 1).bit_length())))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    num_items: torch.Tensor | int | None = None,
    chunk_rows: int | None = None,
    softcap: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """The fp32 0-d loss of the module docstring for ``hidden`` (..., d), ``weight`` (V, d) and integer ``targets``
    of shape ``hidden.shape[:-1]`` (already shifted: target i is the token after position i). ``backend``: "cupy"
    (cuBLAS + ``cross_entropy.cu``, the system under test) or "torch" (the same plan on torch ops). ``softcap``
    c > 0: the logits are c·tanh(z / c) (Gemma 2's ``final_logit_softcapping``)."""
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"softcap={softcap!r}, expected a positive number (or None for no cap)")
    hidden, name = fe.enter(hidden, backend)
    _check(hidden, weight, targets, chunk_rows, name)
    n = targets.numel()
    chunk = chunk_rows or default_chunk_rows(n, weight.shape[0], weight.shape[1])
    cap = float(softcap or 0.0)
    return LinearCrossEntropy.apply(hidden, weight, targets, num_items, int(ignore_index), chunk, cap, name)


def _check(hidden, weight, targets, chunk_rows, backend) -> None:
    """Each error names the bad value and what was expected."""
    allowed = ACTIVATION_DTYPES + (REFERENCE_ONLY_DTYPES if backend == "torch" else ())
    if hidden.dtype not in allowed:
        raise ValueError(f"hidden has dtype {hidden.dtype}, expected one of {allowed} for backend={backend!r}")
    if weight.dim() != 2 or hidden.dim() < 1 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not fit an LM head "
            "(expected hidden (..., d) and weight (V, d))"
        )
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets have shape {tuple(targets.shape)}, expected {tuple(hidden.shape[:-1])} (one per token)"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.is_complex():
        raise ValueError(f"targets have dtype {targets.dtype}, expected an integer dtype (token ids)")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows={chunk_rows!r}, expected a positive int (or None for the default)")
    if weight.device != hidden.device or targets.device != hidden.device:
        raise ValueError(
            f"hidden on {hidden.device}, weight on {weight.device}, targets on {targets.device}: expected one device"
        )


def _scale(targets: torch.Tensor, num_items, ignore_index: int, dtype: torch.dtype) -> torch.Tensor:
    """1/n as a 1-element ``dtype`` tensor on the targets' device (no synchronisation): n counted from ``targets``
    or given as ``num_items``."""
    if num_items is None:
        count = (targets != ignore_index).sum()
    elif torch.is_tensor(num_items):
        count = num_items.to(device=targets.device)
    else:
        count = torch.tensor(num_items, device=targets.device)
    return count.to(dtype).reciprocal().reshape(1)


def ce_vector_width(z: torch.Tensor) -> int:
    """Columns per load in cross_entropy.cu: a 16-byte vector (8 of a 16-bit dtype, 4 of fp32) when every row starts
    on a 16-byte boundary (V a multiple of that width, z aligned), else 1."""
    width = 16 // z.element_size()
    return width if z.shape[-1] % width == 0 and z.data_ptr() % 16 == 0 else 1


def ce_rows_(eng, z, targets, loss_rows, ignore: int, softcap: float = 0.0):
    """One chunk's rows (module docstring): ``loss_rows`` written, ``z`` overwritten by n·dz (a module-level name, so
    that selftest-gpu can plant a defect in it); ``softcap`` c > 0 caps the logits at c·tanh(z / c) first."""
    rows, vocab = z.shape
    if isinstance(eng, cx.on_torch_stream):
        if rows:
            vec = ce_vector_width(z)
            variant = f"VEC={vec}, {kv.passes(vocab // vec, 1, _BLOCK)}" + (", softcap" if softcap > 0 else "")
            kv.note("cross_entropy_rows", z.dtype, variant, (rows,), (_BLOCK,))
            name = f"cross_entropy_rows<{cx.CUDA_TYPE_NAME[z.dtype]}, {vec}>"
            args = (z, targets, loss_rows, vocab, ignore, float(softcap))
            eng.launch("cross_entropy.cu", _KERNELS, name, (rows,), (_BLOCK,), args)
        return
    acc = torch.promote_types(z.dtype, torch.float32)
    zf = z.to(acc)
    chain = None
    if softcap > 0:
        zf = softcap * torch.tanh(zf / softcap)
        chain = 1 - (zf / softcap) ** 2
    lse = torch.logsumexp(zf, dim=-1)
    kept = targets != ignore
    picked = torch.where(kept, targets, torch.zeros_like(targets))
    rows_idx = torch.arange(rows, device=z.device)
    loss_rows.copy_(torch.where(kept, lse - zf[rows_idx, picked], torch.zeros_like(lse)))
    dz = torch.exp(zf - lse[:, None])
    dz[rows_idx, picked] -= 1.0
    dz = dz.mul_(kept[:, None])
    z.copy_(dz if chain is None else dz.mul_(chain))


class LinearCrossEntropy(torch.autograd.Function):
    """The plan in the module docstring, on the engine of the resolved backend (``fused_engine``)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, num_items, ignore_index, chunk, softcap, backend):
        dtype, dev = hidden.dtype, hidden.device
        h2 = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        t = targets.reshape(-1).to(torch.int64).contiguous()
        w = weight if weight.dtype == dtype else weight.to(dtype)
        n, vocab = h2.shape[0], w.shape[0]
        acc = torch.promote_types(dtype, torch.float32)  # fp32 (fp64 on the torch engine's float64 reference)
        scale = _scale(t, num_items, ignore_index, acc)
        loss_rows = torch.empty(n, dtype=acc, device=dev)
        dh = torch.empty_like(h2) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(w.shape, dtype=loss_rows.dtype, device=dev) if ctx.needs_input_grad[1] else None
        z = torch.empty((min(chunk, n), vocab), dtype=dtype, device=dev)
        with fe.engine(backend, dev) as eng:
            for start in range(0, n, chunk):
                end = min(n, start + chunk)
                zc, hc = z[: end - start], h2[start:end]
                eng.gemm(zc, hc, w, trans_b=True)
                ce_rows_(eng, zc, t[start:end], loss_rows[start:end], ignore_index, softcap)
                if dh is not None:
                    eng.gemm(dh[start:end], zc, w)
                if dw is not None:
                    eng.gemm(dw, zc, hc, trans_a=True, beta=1.0)
        del z
        ctx.save_for_backward(dh, dw, scale)
        ctx.h_shape, ctx.w_dtype, ctx.used = hidden.shape, weight.dtype, False
        return loss_rows.sum() * scale[0]

    @staticmethod
    def backward(ctx, g):
        if ctx.used:
            raise RuntimeError(
                "the fused linear cross-entropy's backward scales its saved gradients in place, so it runs once per "
                "forward; a second backward through the same graph (retain_graph=True) is not supported"
            )
        ctx.used = True
        dh, dw, scale = ctx.saved_tensors
        factor = g.to(scale.dtype) * scale[0]  # a 0-d fp32 (fp64) tensor: the products below round once, in fp32
        d_hidden = None if dh is None else dh.mul_(factor).view(ctx.h_shape)
        d_weight = None if dw is None else dw.mul_(factor).to(ctx.w_dtype)
        return d_hidden, d_weight, None, None, None, None, None, None
