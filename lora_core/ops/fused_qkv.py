"""The fused LoRA QKV projection: q, k and v (each ``x W_pᵀ + s·(x A_pᵀ) B_pᵀ``) from one read of x.

Shapes: x (N, K), W_qkv = [W_q; W_k; W_v] (O_q + O_k + O_v, K) frozen (16-bit, or three NF4 weights dequantised
into the parts of one scratch buffer), A_qkv = [A_q; A_k; A_v] (3r, K), B_p (O_p, r); one scale s.

Forward:
    h   = x A_qkvᵀ                                   (N, 3r)        one GEMM
    p    = b_p + s·h_p B_pᵀ + x W_pᵀ   for p in q, k, v   (N, O_p) each    the frozen bias b_p (Qwen2's q/k/v
                                                     biases; none: 0) broadcast into p, then a rank-r GEMM and a base
                                                     GEMM accumulated into it (beta = 1)
q, k and v are three contiguous tensors, each base GEMM reading its row block W_p of the one W_qkv. They were once
column slices of one (N, ΣO) output written by a single base GEMM: the attention's per-head views of a slice are not
contiguous, and Liger's RoPE and the attention copied them back (128 copies of (2, 1024, 32, 128) per step on
Llama-2-7B 2×1024; lora_suite's fused-table profile, issue 47).
Saved: x, h (a checkpointed recompute's dequantised NF4 W_qkv is kept for its backward:
``lora_core.ops.recompute``).

Backward (dq, dk, dv as the attention hands them back; a part with no gradient counts as zero):
    dh   = [dq B_q | dk B_k | dv B_v]                (N, 3r)
    dB_p = s·dpᵀ h_p,   dA_qkv = s·dhᵀ x  -> dA_q, dA_k, dA_v
    dx   = s·dh A_qkv + dq W_q + dk W_k + dv W_v      one buffer, accumulated (beta = 1) GEMM after GEMM
The bias is frozen: it adds nothing to the backward. Limits, refused by ``lora_core.fuse``: no LoRA dropout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_core.backend import count_call
from lora_core.nf4 import NF4Tensor, dequantize_nf4
from lora_core.ops import fused_engine as fe
from lora_core.ops import recompute
from lora_core.ops.fused_engine import bias_into_  # a module-level name: selftest-gpu plants a defect in it


@dataclass(frozen=True)
class QKVBases:
    """The frozen bases: 16-bit ``w_qkv`` [W_q; W_k; W_v] (ΣO, K) with ``sizes`` (O_q, O_k, O_v), or ``nf4``."""

    sizes: tuple[int, int, int]
    w_qkv: torch.Tensor | None = None
    nf4: tuple[NF4Tensor, NF4Tensor, NF4Tensor] | None = None
    bias: torch.Tensor | None = None  # [b_q; b_k; b_v] (ΣO,), frozen; None: no bias

    def _dense(self) -> torch.Tensor:
        """``w_qkv`` of 16-bit bases (``nf4`` None): lora_core.fuse.QKVGroup sets either it or ``nf4``."""
        assert self.w_qkv is not None, "QKVBases without nf4 needs w_qkv"
        return self.w_qkv

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.nf4 is None:
            w_qkv = self._dense()
            return w_qkv if w_qkv.dtype == dtype else w_qkv.to(dtype)
        first = self.nf4[0]
        out = torch.empty((sum(self.sizes), first.shape[1]), dtype=dtype, device=first.device)
        start = 0
        for q in self.nf4:
            dequantize_nf4(q, dtype, out=out[start : start + q.shape[0]])
            start += q.shape[0]
        return out

    def keep(self, w: torch.Tensor, needed: bool) -> None:
        """Keep an NF4 base's dequantised W_qkv for the backward, if this forward is a checkpointed recompute."""
        if self.nf4 is not None:
            recompute.keep(self.nf4[0], "qkv", w, needed)

    def for_backward(self, dtype: torch.dtype) -> torch.Tensor:
        """W_qkv in ``dtype`` for the backward: kept by its recompute, else made again."""
        kept = None if self.nf4 is None else recompute.take(self.nf4[0], "qkv", dtype)
        return self.weight(dtype) if kept is None else kept

    @property
    def in_features(self) -> int:
        return self._dense().shape[1] if self.nf4 is None else self.nf4[0].shape[1]


def lora_qkv(x, bases: QKVBases, adapters, scale: float, *, backend: str | None = None):
    """(q, k, v) with LoRA on each; ``adapters`` = (A_q, B_q, A_k, B_k, A_v, B_v). See ``lora_mlp`` for backend."""
    x, name = fe.enter(x, backend)
    fe.check_dtypes(x, adapters, name)
    _check(x, bases, adapters)
    count_call(name, 3)  # q, k and v
    return FusedLoRAQKV.apply(x, *adapters, bases, float(scale), name)


def _check(x, bases: QKVBases, adapters) -> None:
    k = bases.in_features
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected (..., {k}) to match the q/k/v bases")
    r = adapters[0].shape[0]
    for i, part in enumerate("qkv"):
        a, b = adapters[2 * i], adapters[2 * i + 1]
        if tuple(a.shape) != (r, k) or tuple(b.shape) != (bases.sizes[i], r):
            raise ValueError(
                f"A_{part} {tuple(a.shape)}, B_{part} {tuple(b.shape)}: expected ({r}, {k}) and "
                f"({bases.sizes[i]}, {r}) (one rank r={r} for q, k and v)"
            )
    if bases.nf4 is None and bases._dense().requires_grad:
        raise ValueError("the q/k/v base weight requires grad; the LoRA base is frozen (requires_grad_(False))")
    if bases.bias is not None and (tuple(bases.bias.shape) != (sum(bases.sizes),) or bases.bias.requires_grad):
        raise ValueError(
            f"the q/k/v bias has shape {tuple(bases.bias.shape)} (requires_grad={bases.bias.requires_grad}), expected "
            f"({sum(bases.sizes)},) [b_q; b_k; b_v], frozen"
        )


class FusedLoRAQKV(torch.autograd.Function):
    """The plan in the module docstring, on the engine of the resolved backend (``fused_engine``)."""

    @staticmethod
    def forward(ctx, x, a_q, b_q, a_k, b_k, a_v, b_v, bases, scale, backend):
        dtype, dev = x.dtype, x.device
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        n, k, r = x2.shape[0], x2.shape[1], a_q.shape[0]
        sizes = bases.sizes
        shapes = [tuple(t.shape) for t in (a_q, a_k, a_v, b_q, b_k, b_v)]
        with fe.engine(backend, dev) as eng:
            stacked = fe.stack_cast(eng, [a_q, a_k, a_v, b_q, b_k, b_v], dtype)
            bs = fe.split_views(stacked, shapes)[3:]
            h = torch.empty((n, 3 * r), dtype=dtype, device=dev)
            eng.gemm(h, x2, stacked[: 3 * r * k].view(3 * r, k), trans_b=True)
            w = bases.weight(dtype)
            outs, start = [], 0
            for i, size in enumerate(sizes):  # each part its own contiguous tensor (module docstring: why)
                out = torch.empty((n, size), dtype=dtype, device=dev)
                beta = bias_into_(out, bases.bias, start)
                eng.gemm(out, h[:, i * r : (i + 1) * r], bs[i], trans_b=True, alpha=scale, beta=beta)
                outs.append(eng.gemm(out, x2, w[start : start + size], trans_b=True, beta=1.0))
                start += size
            bases.keep(w, ctx.needs_input_grad[0])  # the backward reads it for dx only
            del w
        ctx.save_for_backward(x2, h, stacked)
        ctx.bases, ctx.scale, ctx.backend, ctx.shapes, ctx.x_shape = bases, scale, backend, shapes, x.shape
        ctx.adapter_dtype = a_q.dtype
        lead = x.shape[:-1]
        return tuple(outs[i].view(*lead, sizes[i]) for i in range(3))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x2, h, stacked = ctx.saved_tensors
        n, k = x2.shape
        r = ctx.shapes[0][0]
        bs = fe.split_views(stacked, ctx.shapes)[3:]
        sizes, s, acc_dtype = ctx.bases.sizes, ctx.scale, ctx.adapter_dtype
        dtype, dev = x2.dtype, x2.device
        grads = [None if d is None else d.reshape(-1, sizes[i]).contiguous() for i, d in enumerate((dq, dk, dv))]
        with fe.engine(ctx.backend, dev) as eng:
            dh = torch.empty((n, 3 * r), dtype=dtype, device=dev)
            dbs = []
            for i, d in enumerate(grads):
                if d is None:
                    dh[:, i * r : (i + 1) * r].zero_()
                    dbs.append(torch.zeros((sizes[i], r), dtype=acc_dtype, device=dev))
                    continue
                eng.gemm(dh[:, i * r : (i + 1) * r], d, bs[i])
                db = torch.empty((sizes[i], r), dtype=acc_dtype, device=dev)
                dbs.append(eng.gemm(db, d, h[:, i * r : (i + 1) * r], trans_a=True, alpha=s))
            a_qkv = stacked[: 3 * r * k].view(3 * r, k)
            da, dx = fe.stacked_a_backward(eng, dh, x2, a_qkv, s, acc_dtype, ctx.needs_input_grad[0])
            if dx is not None:
                w = ctx.bases.for_backward(dtype)
                start = 0
                for i, d in enumerate(grads):
                    if d is not None:
                        accumulate_dx(eng, dx, d, w[start : start + sizes[i]])
                    start += sizes[i]
                dx = dx.view(ctx.x_shape)
        return dx, da[:r], dbs[0], da[r : 2 * r], dbs[1], da[2 * r :], dbs[2], None, None, None


def accumulate_dx(eng, dx, d_part, w_part):
    """dx += d_p W_p for one of q, k, v (a module-level name, so selftest-gpu can plant a defect in it)."""
    eng.gemm(dx, d_part, w_part, beta=1.0)
