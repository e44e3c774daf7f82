"""The LoRA op registered with PyTorch: ``torch.ops.lora_core.lora_linear`` and its backward.

A ``torch.autograd.Function`` is opaque to ``torch.compile``; an op registered with ``torch.library.custom_op``
is one node of the traced graph, with a fake implementation (output shapes and dtypes without data) for
tracing and an autograd formula, so ``torch.compile(model, fullgraph=True)`` traces a model made of these
layers without a graph break, and ``mode="reduce-overhead"`` can capture it in a CUDA graph.

Implementations: on CUDA tensors, the project's cuBLAS + CuPy path (``lora_core.ops.cupy_lora``, the system
under test; it needs CuPy and nvmath-python and raises ``CupyUnavailableError`` without them, never
falling back); on every other device, plain torch ops (so the registration, fake implementations and
autograd are tested on the CPU). ``lora_linear(..., backend="cupy")`` routes through this op while
``torch.compile`` traces; eager calls take the autograd Function (``CupyLoRALinear``) over the same
functions, which costs less host time per call than the dispatcher's custom-op path.

Math (x (..., K), W (O, K) frozen, A (r, K), B (O, r), s a float; N = prod(x.shape[:-1])):

    forward:   h = x Aᵀ                    (N, r)   returned, and saved for the backward: never recomputed
               y = x Wᵀ + s · h Bᵀ         (N, O)
    backward:  dH = dY B                   (N, r)
               dB = s · dYᵀ h              (O, r)
               dA = s · dHᵀ x              (r, K)
               dx = dY W + s · dH A        (N, K)   only when x requires grad

Adapters may be fp32 under 16-bit activations (PEFT's default): they are cast to the activation dtype for the
products, and dA, dB come back in the adapters' own dtype, accumulated in fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lora_core.backend import count_call
from lora_core.ops import cupy_interop as cx
from lora_core.ops import cupy_lora

NAMESPACE = "lora_core"


def _flat(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


@torch.library.custom_op(f"{NAMESPACE}::lora_linear", mutates_args=())
def lora_linear_forward(
    x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """(y, h) with y = x Wᵀ + s·(x Aᵀ) Bᵀ and h = x Aᵀ, in x's dtype."""
    h = torch.nn.functional.linear(x, lora_a.to(x.dtype))
    y = torch.nn.functional.linear(x, weight)
    y.add_(torch.nn.functional.linear(h, lora_b.to(x.dtype)), alpha=scale)
    return y, h


@lora_linear_forward.register_kernel("cuda")
def _lora_linear_cuda(x, weight, lora_a, lora_b, scale):
    count_call("cupy")  # runs each time the op runs eagerly (not on a CUDA graph's replay): the path is visible
    lead = x.shape[:-1]
    with cx.on_torch_stream(x.device) as cu:
        a_c, b_c = cupy_lora.adapters_in(cu, lora_a, lora_b, x.dtype)
        y, h = cupy_lora.forward(cu, _flat(x).contiguous(), weight.contiguous(), a_c, b_c, scale)
    return y.view(*lead, y.shape[-1]), h.view(*lead, h.shape[-1])


@lora_linear_forward.register_fake
def _(x, weight, lora_a, lora_b, scale):
    lead = x.shape[:-1]
    return x.new_empty((*lead, weight.shape[0])), x.new_empty((*lead, lora_a.shape[0]))


@torch.library.custom_op(f"{NAMESPACE}::lora_linear_backward", mutates_args=())
def lora_linear_backward(
    dy: Tensor, x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, h: Tensor, scale: float, needs_dx: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dA, dB) of the forward above; dx is an empty tensor when ``needs_dx`` is False."""
    dy2, x2, h2 = _flat(dy), _flat(x), _flat(h)
    b = lora_b.to(dy.dtype)
    dh = dy2 @ b  # (N, r)
    acc = torch.promote_types(torch.promote_types(dy.dtype, lora_a.dtype), torch.float32)  # fp32, or fp64
    db = (dy2.t().to(acc) @ h2.to(acc)).mul_(scale).to(lora_b.dtype)  # (O, r)
    da = (dh.t().to(acc) @ x2.to(acc)).mul_(scale).to(lora_a.dtype)  # (r, K)
    if needs_dx:
        dx = (dy2 @ weight).addmm_(dh, lora_a.to(dy.dtype), alpha=scale).reshape(x.shape)
    else:
        dx = x.new_empty(0)
    return dx, da, db


@lora_linear_backward.register_kernel("cuda")
def _lora_linear_backward_cuda(dy, x, weight, lora_a, lora_b, h, scale, needs_dx):
    with cx.on_torch_stream(dy.device) as cu:
        a_c, b_c = cupy_lora.adapters_in(cu, lora_a, lora_b, dy.dtype)
        dx, da, db = cupy_lora.backward(
            cu,
            _flat(dy).contiguous(),
            _flat(x).contiguous(),
            weight.contiguous(),
            a_c,
            b_c,
            _flat(h).contiguous(),
            scale,
            need_x=needs_dx,
            need_a=True,
            need_b=True,
            adapter_dtype=lora_a.dtype,
        )
    return (dx.view(x.shape) if needs_dx else x.new_empty(0)), da, db


@lora_linear_backward.register_fake
def _(dy, x, weight, lora_a, lora_b, h, scale, needs_dx):
    dx = x.new_empty(x.shape) if needs_dx else x.new_empty(0)
    return dx, lora_a.new_empty(lora_a.shape), lora_b.new_empty(lora_b.shape)


def _setup_context(ctx, inputs, output):
    x, weight, lora_a, lora_b, scale = inputs
    _, h = output
    ctx.scale = scale
    ctx.needs_dx = ctx.needs_input_grad[0]
    ctx.save_for_backward(x, weight, lora_a, lora_b, h)


def _backward(ctx, dy, _dh):
    # _dh: the gradient reaching h, which is an internal output (lora_linear_op never returns it): none.
    x, weight, lora_a, lora_b, h = ctx.saved_tensors
    dx, da, db = torch.ops.lora_core.lora_linear_backward(
        dy.contiguous(), x, weight, lora_a, lora_b, h, ctx.scale, ctx.needs_dx
    )
    return (dx if ctx.needs_dx else None), None, da, db, None


lora_linear_forward.register_autograd(_backward, setup_context=_setup_context)


def lora_linear_op(x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float) -> Tensor:
    """``y = x Wᵀ + scale·(x Aᵀ) Bᵀ`` through the registered op (traceable by torch.compile as one node)."""
    if weight.requires_grad:
        raise ValueError("weight is the frozen base weight and must not require grad")
    if (
        x.shape[-1] != weight.shape[1]
        or lora_a.shape != (lora_a.shape[0], weight.shape[1])
        or lora_b.shape != (weight.shape[0], lora_a.shape[0])
    ):
        raise ValueError(
            f"shapes do not fit y = x Wᵀ + s·(x Aᵀ) Bᵀ: x {tuple(x.shape)}, weight "
            f"{tuple(weight.shape)}, lora_a {tuple(lora_a.shape)} (expected (r, {weight.shape[1]})), "
            f"lora_b {tuple(lora_b.shape)} (expected ({weight.shape[0]}, r))"
        )
    y, _ = torch.ops.lora_core.lora_linear(x, weight, lora_a, lora_b, float(scale))
    return y
