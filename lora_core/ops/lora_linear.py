"""The LoRA linear op: ``y = x Wᵀ + s·(x Aᵀ) Bᵀ``, as a CuPy/cuBLAS autograd Function and a torch reference.

Shapes: x (..., K) · W (O, K) frozen · A (r, K) · B (O, r) · s a Python float. N = prod(x.shape[:-1]).

Dtypes: activations x and W in fp32, fp16 or bf16 (the torch reference also takes fp64, for
gradcheck). Adapters A and B are either in the activation dtype or, under 16-bit activations, in fp32
(PEFT's default). With fp32 adapters the casts are explicit: A and B are cast to the activation dtype
for the GEMMs (the ``cast.cu`` RawKernel; ``Tensor.to`` on the torch path) and dA, dB come back in
fp32. Under ``torch.autocast`` x and W are first cast to the autocast dtype, as ``F.linear`` would.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
import torch.nn.functional as F

from lora_core.backend import count_call, resolve_backend
from lora_core.nf4 import NF4Tensor, dequantize_nf4
from lora_core.ops import cupy_interop as cx
from lora_core.ops import cupy_lora, recompute
from lora_core.ops.registered import lora_linear_op

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
REFERENCE_ONLY_DTYPES = (torch.float64,)  # accepted by the torch backend only (gradcheck)


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor | NF4Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``y = x Wᵀ + scale·(x Aᵀ) Bᵀ`` with gradients for x (if it requires grad), lora_a and lora_b.

    ``weight`` is the frozen base weight and never receives a gradient: passing one that requires grad
    is an error. ``weight`` may also be an ``NF4Tensor`` (QLoRA): it is then dequantised to the activation
    dtype for each GEMM that needs it, forward and again backward, never kept in 16 bits between them.
    ``backend`` is ``"cupy"``, ``"torch"`` or None (see ``lora_core.backend``); which
    backend ran is counted in ``lora_core.backend_call_counts()`` and, for the cupy path, shows in the
    result's ``grad_fn`` (``CupyLoRALinearBackward``).
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    x, weight, lora_a, lora_b = _apply_autocast(x, weight, lora_a, lora_b)
    name = resolve_backend(backend, x.device)
    check_inputs(x, weight, lora_a, lora_b, scale, backend=name)
    compiling = torch.compiler.is_compiling()
    if not compiling:  # under torch.compile, a Python counter would only count the trace
        count_call(name)
    if name == "cupy":
        if compiling:  # one traceable node: the registered op, whose CUDA implementation is the same cupy path
            if isinstance(weight, NF4Tensor):
                raise ValueError(
                    "an NF4 base weight under torch.compile is not supported by the registered "
                    "lora_core::lora_linear op (it takes a dense weight); run the NF4 model eagerly "
                    "or captured with train.cuda_graph"
                )
            return lora_linear_op(x, weight, lora_a, lora_b, float(scale))
        return CupyLoRALinear.apply(x, weight, lora_a, lora_b, float(scale))
    if isinstance(weight, NF4Tensor):  # the reference keeps its dequantised copy for autograd: reference only
        weight = dequantize_nf4(weight, x.dtype)
    return lora_linear_torch(x, weight, lora_a, lora_b, float(scale))


def nf4_linear(x: torch.Tensor, weight: NF4Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``y = x Ŵᵀ`` for a frozen NF4 weight (QLoRA layers without adapters); gradient for x only."""
    if not isinstance(weight, NF4Tensor):
        raise ValueError(f"nf4_linear expects an NF4Tensor weight, got {type(weight).__name__}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x has shape {tuple(x.shape)}, expected (..., {weight.shape[1]}) to match weight {weight.shape}"
        )
    if x.dtype not in ACTIVATION_DTYPES or x.device != weight.device:
        raise ValueError(f"x is {x.dtype} on {x.device}; expected one of {ACTIVATION_DTYPES} on {weight.device}")
    name = resolve_backend(backend, x.device)
    count_call(name)
    if name == "cupy":
        return CupyNF4Linear.apply(x, weight)
    return F.linear(x, dequantize_nf4(weight, x.dtype))


def lora_linear_torch(
    x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
) -> torch.Tensor:
    """The reference: plain torch ops, gradients by autograd. Same math and casts as the cupy path."""
    h = F.linear(x, lora_a.to(x.dtype))  # (..., r)
    return F.linear(x, weight) + scale * F.linear(h, lora_b.to(x.dtype))  # (..., O)


class CupyLoRALinear(torch.autograd.Function):
    """LoRA linear on cuBLAS (gemmEx) and CuPy RawKernels: the products and their GEMM plan are in
    ``lora_core.ops.cupy_lora``; this Function saves x, h and the compute-dtype adapters between them.

    An NF4 weight is not saved in 16 bits: the backward dequantises it again, only if dx is needed, unless a
    checkpointed recompute kept its dequantised copy for this backward (``lora_core.ops.recompute``).
    """

    @staticmethod
    def forward(ctx, x, weight, lora_a, lora_b, scale):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (N, K) act
        nf4 = weight if isinstance(weight, NF4Tensor) else None
        w = dequantize_nf4(nf4, x.dtype) if nf4 is not None else weight.contiguous()  # (O, K) act (scratch if NF4)
        with cx.on_torch_stream(x.device) as cu:
            a_c, b_c = cupy_lora.adapters_in(cu, lora_a, lora_b, x.dtype)  # (r, K), (O, r) act
            y, h = cupy_lora.forward(cu, x2, w, a_c, b_c, scale)
        if nf4 is not None:
            recompute.keep(nf4, "w", w, ctx.needs_input_grad[0])
        # ctx keeps a reference to the NF4Tensor itself: frozen module state (like a Parameter), not an activation.
        ctx.save_for_backward(x2, h, None if nf4 is not None else w, a_c, b_c)
        ctx.nf4 = nf4
        ctx.scale = scale
        ctx.x_shape = x.shape
        ctx.adapter_dtype = lora_a.dtype
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, h, w, a_c, b_c = ctx.saved_tensors
        need_x, _, need_a, need_b, _ = ctx.needs_input_grad
        dy2 = dy.reshape(-1, b_c.shape[0]).contiguous()  # (N, O) act
        if ctx.nf4 is not None:
            nf4 = ctx.nf4
            kept = recompute.take(nf4, "w", dy2.dtype) if need_x else None
            w = kept if kept is not None else lambda: dequantize_nf4(nf4, dy2.dtype)  # (O, K) act scratch
        with cx.on_torch_stream(dy2.device) as cu:
            dx, da, db = cupy_lora.backward(
                cu,
                dy2,
                x2,
                w,
                a_c,
                b_c,
                h,
                ctx.scale,
                need_x=need_x,
                need_a=need_a,
                need_b=need_b,
                adapter_dtype=ctx.adapter_dtype,
            )
        return (None if dx is None else dx.view(ctx.x_shape)), None, da, db, None


class CupyNF4Linear(torch.autograd.Function):
    """Frozen NF4 linear: y = x Ŵᵀ, dx = dY Ŵ; Ŵ dequantised (RawKernel) into scratch in each pass, or in the
    backward taken from a checkpointed recompute (``lora_core.ops.recompute``)."""

    @staticmethod
    def forward(ctx, x, weight):
        out_features, in_features = weight.shape
        x2 = x.reshape(-1, in_features).contiguous()  # (N, K) act
        w = dequantize_nf4(weight, x.dtype)  # (O, K) act scratch
        y = torch.empty((x2.shape[0], out_features), dtype=x.dtype, device=x.device)  # (N, O) act
        with cx.on_torch_stream(x.device) as cu:
            cu.gemm(y, x2, w, trans_b=True)
        recompute.keep(weight, "w", w, ctx.needs_input_grad[0])
        ctx.nf4, ctx.x_shape = weight, x.shape
        return y.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, dy):
        if not ctx.needs_input_grad[0]:
            return None, None
        out_features, in_features = ctx.nf4.shape
        dy2 = dy.reshape(-1, out_features).contiguous()  # (N, O) act
        w = recompute.take(ctx.nf4, "w", dy2.dtype)
        if w is None:
            w = dequantize_nf4(ctx.nf4, dy2.dtype)  # (O, K) act scratch
        dx = torch.empty((dy2.shape[0], in_features), dtype=dy2.dtype, device=dy2.device)  # (N, K) act
        with cx.on_torch_stream(dy2.device) as cu:
            cu.gemm(dx, dy2, w)
        return dx.view(ctx.x_shape), None


def _apply_autocast(x, weight, lora_a, lora_b):
    """Under torch.autocast, run in the autocast dtype like F.linear: cast x and W (explicitly)."""
    device_type = x.device.type
    if not (x.is_floating_point() and torch.is_autocast_enabled(device_type)):
        return x, weight, lora_a, lora_b
    dtype = torch.get_autocast_dtype(device_type)
    x = x.to(dtype)
    weight = weight if isinstance(weight, NF4Tensor) else weight.to(dtype)  # NF4 dequantises to x's dtype
    if lora_a.dtype not in (dtype, torch.float32):
        lora_a, lora_b = lora_a.to(dtype), lora_b.to(dtype)
    return x, weight, lora_a, lora_b


def check_inputs(x, weight, lora_a, lora_b, scale, *, backend: str) -> None:
    """Validate at the boundary; each error names the bad value and what was expected."""
    nf4 = isinstance(weight, NF4Tensor)
    for name, t in (("weight", weight), ("lora_a", lora_a), ("lora_b", lora_b)):
        if nf4 and name == "weight":
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if len(weight.shape) != 2:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected 2-D (out_features, in_features)")
    out_features, in_features = weight.shape
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(
            f"x has shape {tuple(x.shape)}, expected (..., {in_features}) to match weight {tuple(weight.shape)}"
        )
    if lora_a.dim() != 2 or lora_a.shape[1] != in_features or lora_a.shape[0] < 1:
        raise ValueError(f"lora_a has shape {tuple(lora_a.shape)}, expected (r, {in_features}) with r >= 1")
    r = lora_a.shape[0]
    if tuple(lora_b.shape) != (out_features, r):
        raise ValueError(f"lora_b has shape {tuple(lora_b.shape)}, expected ({out_features}, {r})")
    devices = {name: t.device for name, t in (("x", x), ("weight", weight), ("lora_a", lora_a), ("lora_b", lora_b))}
    if len(set(devices.values())) != 1:
        raise ValueError(
            f"all tensors must be on one device, got {', '.join(f'{k} on {v}' for k, v in devices.items())}"
        )
    allowed = ACTIVATION_DTYPES + (REFERENCE_ONLY_DTYPES if backend == "torch" else ())
    if x.dtype not in allowed:
        raise ValueError(f"x has dtype {x.dtype}, expected one of {allowed} for backend={backend!r}")
    if not nf4 and weight.dtype != x.dtype:
        raise ValueError(
            f"weight has dtype {weight.dtype} but x has {x.dtype}; they must match (or run under torch.autocast)"
        )
    if lora_a.dtype != lora_b.dtype:
        raise ValueError(f"lora_a has dtype {lora_a.dtype} but lora_b has {lora_b.dtype}; they must match")
    adapter_ok = (x.dtype,) + ((torch.float32,) if x.dtype in (torch.float16, torch.bfloat16) else ())
    if lora_a.dtype not in adapter_ok:
        raise ValueError(
            f"adapters have dtype {lora_a.dtype}, expected {' or '.join(map(str, adapter_ok))} for x of dtype {x.dtype}"
        )
    if not nf4 and weight.requires_grad:
        raise ValueError(
            "weight requires grad, but the LoRA base weight is frozen and never gets a gradient; "
            "call weight.requires_grad_(False) (or pass weight.detach())"
        )
    if isinstance(scale, torch.Tensor) or not isinstance(scale, Real) or not math.isfinite(float(scale)):
        raise ValueError(f"scale={scale!r} must be a finite Python number (alpha / r)")
