"""The fused LoRA MLP: ``y = down(f(gate(x)) · up(x))`` with LoRA on all three, as one autograd Function; f is SiLU
(SwiGLU, Llama) or the tanh GELU (GeGLU, Gemma): the steps below are written for SiLU, GeGLU's differ only in f.

Each projection p is ``x W_pᵀ + s·(x A_pᵀ) B_pᵀ`` (W frozen, 16-bit or NF4). Shapes: x (N, K), W_g, W_u (I, K),
W_d (H, I) with H = K, A_g, A_u (r, K), B_g, B_u (I, r), A_d (r, I), B_d (H, r); s for gate and up, s_d for down.

Forward (gate and up share every read of x: W_gu = [W_g; W_u] (2I, K), A_gu = [A_g; A_u] (2r, K)):
    h_gu = x A_guᵀ                                   (N, 2r)   one GEMM
    gu   = b_gu + [s·h_g B_gᵀ | s·h_u B_uᵀ] + x W_guᵀ (N, 2I)   two rank-r GEMMs into the halves, one base GEMM
    act  = silu(g) · u                               (N, I)    swiglu.cu
    h_d  = act A_dᵀ,  y = b_d + s_d·h_d B_dᵀ + act W_dᵀ (N, H)
b_gu = [b_g | b_u] and b_d are the frozen biases (none: 0), broadcast into gu and y before their GEMMs accumulate.
Saved: x, gu, h_gu, h_d; not act (the backward recomputes it from gu), not a 16-bit copy of an NF4 base (a
checkpointed recompute's copies are kept for the backward that follows it: ``lora_core.ops.recompute``).

Backward:
    dh_d = dY B_d,  dB_d = s_d·dYᵀ h_d,  dact = s_d·dh_d A_d + dY W_d
    [dg | du], act = swiglu backward in place over gu and dact (silu'(g) = σ(1 + g(1 - σ)))
    dA_d = s_d·dh_dᵀ act
    dh_gu = [dg B_g | du B_u]                        (N, 2r)
    dB_g = s·dgᵀ h_g,  dB_u = s·duᵀ h_u,  dA_gu = s·dh_guᵀ x  -> dA_g, dA_u
    dx = s·dh_gu A_gu + [dg | du] W_gu               one buffer: the gate and up contributions in two GEMMs

The backward overwrites the saved gu, so it runs once per forward (a second backward through the same graph is
refused by name). Limits, refused by ``lora_core.fuse``: no LoRA dropout, a gate that is neither SiLU nor the
tanh GELU. The biases add nothing to the backward: they are frozen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_core.backend import count_call
from lora_core.nf4 import NF4Tensor, dequantize_nf4
from lora_core.ops import fused_engine as fe
from lora_core.ops import recompute
from lora_core.ops.fused_engine import bias_into_

_FIRST_NF4 = {"gate_up": 0, "down": 2}  # a part's first weight in MLPBases.nf4 (gate, up, down)


@dataclass(frozen=True)
class MLPBases:
    """The frozen bases: 16-bit ``w_gu`` [W_g; W_u] (2I, K) and ``w_d`` (H, I), or NF4 ``nf4`` (gate, up, down); the
    frozen biases ``bias_gu`` [b_g; b_u] (2I,) (zeros for a part without one) and ``bias_d`` (H,), None: none."""

    w_gu: torch.Tensor | None = None
    w_d: torch.Tensor | None = None
    nf4: tuple[NF4Tensor, NF4Tensor, NF4Tensor] | None = None
    bias_gu: torch.Tensor | None = None
    bias_d: torch.Tensor | None = None

    def _dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_gu, w_d) of 16-bit bases (``nf4`` None): lora_core.fuse.LoRAMLP sets either both or ``nf4``."""
        assert self.w_gu is not None and self.w_d is not None, "MLPBases without nf4 needs w_gu and w_d"
        return self.w_gu, self.w_d

    def gate_up(self, dtype: torch.dtype) -> torch.Tensor:
        """[W_g; W_u] in ``dtype``: the stored one, or NF4 dequantised into the two halves of one scratch buffer."""
        if self.nf4 is None:
            w_gu, _ = self._dense()
            return w_gu if w_gu.dtype == dtype else w_gu.to(dtype)
        g, u, _ = self.nf4
        out = torch.empty((g.shape[0] + u.shape[0], g.shape[1]), dtype=dtype, device=g.device)
        dequantize_nf4(g, dtype, out=out[: g.shape[0]])
        dequantize_nf4(u, dtype, out=out[g.shape[0] :])
        return out

    def down(self, dtype: torch.dtype) -> torch.Tensor:
        if self.nf4 is None:
            _, w_d = self._dense()
            return w_d if w_d.dtype == dtype else w_d.to(dtype)
        return dequantize_nf4(self.nf4[2], dtype)

    def keep(self, part: str, w: torch.Tensor, needed: bool = True) -> None:
        """Keep the dequantised ``part`` ("gate_up" or "down") of an NF4 base for the backward, if this forward is a
        checkpointed recompute (``lora_core.ops.recompute``); nothing for a 16-bit base. The part is keyed by its
        first NF4 weight: gate for [W_g; W_u], down for W_d."""
        if self.nf4 is not None:
            recompute.keep(self.nf4[_FIRST_NF4[part]], part, w, needed)

    def for_backward(self, part: str, dtype: torch.dtype) -> torch.Tensor:
        """``part`` in ``dtype`` for the backward: kept by its recompute, else made again."""
        kept = None if self.nf4 is None else recompute.take(self.nf4[_FIRST_NF4[part]], part, dtype)
        if kept is not None:
            return kept
        return self.gate_up(dtype) if part == "gate_up" else self.down(dtype)

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if self.nf4 is None:
            w_gu, w_d = self._dense()
            return tuple(w_gu.shape), tuple(w_d.shape)
        g, u, d = self.nf4
        return (g.shape[0] + u.shape[0], g.shape[1]), tuple(d.shape)


def lora_mlp(
    x, bases: MLPBases, adapters, scale: float, scale_down: float, *, backend: str | None = None, activation="silu"
):
    """``down(f(gate(x)) · up(x))`` with LoRA; ``adapters`` = (A_g, B_g, A_u, B_u, A_d, B_d); f the gate
    ``activation``: "silu" (SwiGLU, Llama) or "gelu_tanh" (GeGLU, Gemma's ``gelu_pytorch_tanh``).

    ``backend``: "cupy" (the system under test) or "torch" (the same plan on torch ops), resolved as for
    ``lora_linear``; every call is counted under the backend that ran.
    """
    x, name = fe.enter(x, backend)
    fe.check_dtypes(x, adapters, name)
    _check(x, bases, adapters)
    if activation not in fe.ACTIVATIONS:
        raise ValueError(f"activation={activation!r}, expected one of {sorted(fe.ACTIVATIONS)}")
    count_call(name, 3)  # gate, up and down
    return FusedLoRAMLP.apply(x, *adapters, bases, float(scale), float(scale_down), name, activation)


def _check(x, bases: MLPBases, adapters) -> None:
    """Each error names the bad value and what was expected."""
    (two_i, k), (h, inter) = bases.shapes()
    a_g, b_g, a_u, b_u, a_d, b_d = adapters
    if x.dim() < 1 or x.shape[-1] != k or two_i != 2 * inter or h != k:
        raise ValueError(
            f"x {tuple(x.shape)} and bases gate+up {(two_i, k)}, down {(h, inter)} do not fit an MLP "
            "(expected x (..., K), gate and up (I, K) each, down (K, I))"
        )
    r = a_g.shape[0]
    want = {"A_gate": (r, k), "B_gate": (inter, r), "A_up": (r, k), "B_up": (inter, r), "A_down": (r, inter)}
    want["B_down"] = (h, r)
    for (what, shape), t in zip(want.items(), adapters):
        if tuple(t.shape) != shape:
            raise ValueError(f"{what} has shape {tuple(t.shape)}, expected {shape} (one rank r={r} for the MLP)")
    if bases.nf4 is None and any(w.requires_grad for w in bases._dense()):
        raise ValueError("a base weight of the MLP requires grad; the LoRA base is frozen (requires_grad_(False))")
    for what, b, size in (("[b_gate; b_up]", bases.bias_gu, two_i), ("b_down", bases.bias_d, h)):
        if b is not None and (tuple(b.shape) != (size,) or b.requires_grad):
            raise ValueError(
                f"the MLP bias {what} has shape {tuple(b.shape)} (requires_grad={b.requires_grad}), expected "
                f"({size},), frozen"
            )


class FusedLoRAMLP(torch.autograd.Function):
    """The plan in the module docstring, on the engine of the resolved backend (``fused_engine``)."""

    @staticmethod
    def forward(ctx, x, a_g, b_g, a_u, b_u, a_d, b_d, bases, scale, scale_d, backend, activation):
        dtype = x.dtype
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (N, K)
        n, r = x2.shape[0], a_g.shape[0]
        inter, h_out = b_g.shape[0], b_d.shape[0]
        shapes = [tuple(t.shape) for t in (a_g, a_u, b_g, b_u, a_d, b_d)]
        w_gu = bases.gate_up(dtype)
        with fe.engine(backend, x.device) as eng:
            stacked = fe.stack_cast(eng, [a_g, a_u, b_g, b_u, a_d, b_d], dtype)
            a_g_c, a_u_c, b_g_c, b_u_c, a_d_c, b_d_c = fe.split_views(stacked, shapes)
            a_gu = stacked[: 2 * r * a_g.shape[1]].view(2 * r, -1)  # [A_g; A_u] (2r, K)
            h_gu = torch.empty((n, 2 * r), dtype=dtype, device=x.device)
            eng.gemm(h_gu, x2, a_gu, trans_b=True)
            gu = torch.empty((n, 2 * inter), dtype=dtype, device=x.device)
            beta = bias_into_(gu, bases.bias_gu)
            eng.gemm(gu[:, :inter], h_gu[:, :r], b_g_c, trans_b=True, alpha=scale, beta=beta)
            eng.gemm(gu[:, inter:], h_gu[:, r:], b_u_c, trans_b=True, alpha=scale, beta=beta)
            eng.gemm(gu, x2, w_gu, trans_b=True, beta=1.0)
            bases.keep("gate_up", w_gu, ctx.needs_input_grad[0])  # the backward reads it for dx only
            del w_gu  # an NF4 base's scratch is freed here (unless a recompute kept it)
            act = fe.swiglu_forward(eng, gu, activation)
            h_d = torch.empty((n, r), dtype=dtype, device=x.device)
            eng.gemm(h_d, act, a_d_c, trans_b=True)
            y = torch.empty((n, h_out), dtype=dtype, device=x.device)
            eng.gemm(y, h_d, b_d_c, trans_b=True, alpha=scale_d, beta=bias_into_(y, bases.bias_d))
            w_d = bases.down(dtype)
            eng.gemm(y, act, w_d, trans_b=True, beta=1.0)
            bases.keep("down", w_d)  # dact = s_d·dh_d A_d + dY W_d: every backward reads it
            del w_d
        ctx.save_for_backward(x2, gu, h_gu, h_d, stacked)
        ctx.bases, ctx.scale, ctx.scale_d, ctx.backend, ctx.activation = bases, scale, scale_d, backend, activation
        ctx.shapes, ctx.x_shape, ctx.adapter_dtype, ctx.used = shapes, x.shape, a_g.dtype, False
        return y.view(*x.shape[:-1], h_out)

    @staticmethod
    def backward(ctx, dy):
        if ctx.used:
            raise RuntimeError(
                "the fused LoRA MLP's backward overwrites its saved gate/up buffer, so it runs once per forward; "
                "a second backward through the same graph (retain_graph=True) is not supported"
            )
        ctx.used = True
        x2, gu, h_gu, h_d, stacked = ctx.saved_tensors
        a_g_c, a_u_c, b_g_c, b_u_c, a_d_c, b_d_c = fe.split_views(stacked, ctx.shapes)
        n, k = x2.shape
        r, inter, h_out = a_g_c.shape[0], b_g_c.shape[0], b_d_c.shape[0]
        s, s_d, acc_dtype = ctx.scale, ctx.scale_d, ctx.adapter_dtype
        dy2 = dy.reshape(-1, h_out).contiguous()
        dtype, dev = dy2.dtype, dy2.device
        with fe.engine(ctx.backend, dev) as eng:
            dh_d = torch.empty((n, r), dtype=dtype, device=dev)
            eng.gemm(dh_d, dy2, b_d_c)
            db_d = torch.empty((h_out, r), dtype=acc_dtype, device=dev)
            eng.gemm(db_d, dy2, h_d, trans_a=True, alpha=s_d)
            dact = torch.empty((n, inter), dtype=dtype, device=dev)
            eng.gemm(dact, dh_d, a_d_c, alpha=s_d)
            eng.gemm(dact, dy2, ctx.bases.for_backward("down", dtype), beta=1.0)
            swiglu_backward_(eng, dact, gu, ctx.activation)  # gu <- [dg | du]; dact <- act
            da_d = torch.empty((r, inter), dtype=acc_dtype, device=dev)
            eng.gemm(da_d, dh_d, dact, trans_a=True, alpha=s_d)
            del dact
            dh_gu = torch.empty((n, 2 * r), dtype=dtype, device=dev)
            eng.gemm(dh_gu[:, :r], gu[:, :inter], b_g_c)
            eng.gemm(dh_gu[:, r:], gu[:, inter:], b_u_c)
            db_g = torch.empty((inter, r), dtype=acc_dtype, device=dev)
            eng.gemm(db_g, gu[:, :inter], h_gu[:, :r], trans_a=True, alpha=s)
            db_u = torch.empty((inter, r), dtype=acc_dtype, device=dev)
            eng.gemm(db_u, gu[:, inter:], h_gu[:, r:], trans_a=True, alpha=s)
            a_gu = stacked[: 2 * r * k].view(2 * r, k)
            da_gu, dx = fe.stacked_a_backward(eng, dh_gu, x2, a_gu, s, acc_dtype, ctx.needs_input_grad[0])
            if dx is not None:
                eng.gemm(dx, gu, ctx.bases.for_backward("gate_up", dtype), beta=1.0)
                dx = dx.view(ctx.x_shape)
        return dx, da_gu[:r], db_g, da_gu[r:], db_u, da_d, db_d, None, None, None, None, None


def swiglu_backward_(eng, dact, gu, activation="silu"):
    """The gated activation's backward step of the plan (a module-level name, so selftest-gpu can plant a defect in
    it)."""
    fe.swiglu_backward_(eng, dact, gu, activation)
