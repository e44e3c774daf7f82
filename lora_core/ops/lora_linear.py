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

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
REFERENCE_ONLY_DTYPES = (torch.float64,)  # accepted by the torch backend only (gradcheck)
_CAST_KERNELS = tuple(f"cast_from_f32<{cx.CUDA_TYPE_NAME[d]}>" for d in (torch.bfloat16, torch.float16))
_CAST_BLOCK = 256
_CAST_MAX_GRID = 4096  # the kernel is grid-stride; more blocks than this buys nothing for r×K adapters


def lora_linear(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                scale: float, *, backend: str | None = None) -> torch.Tensor:
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
    count_call(name)
    if name == "cupy":
        return CupyLoRALinear.apply(x, weight, lora_a, lora_b, float(scale))
    if isinstance(weight, NF4Tensor):  # the reference keeps its dequantised copy for autograd: reference only
        weight = dequantize_nf4(weight, x.dtype)
    return lora_linear_torch(x, weight, lora_a, lora_b, float(scale))


def nf4_linear(x: torch.Tensor, weight: NF4Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``y = x Ŵᵀ`` for a frozen NF4 weight (QLoRA layers without adapters); gradient for x only."""
    if not isinstance(weight, NF4Tensor):
        raise ValueError(f"nf4_linear expects an NF4Tensor weight, got {type(weight).__name__}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected (..., {weight.shape[1]}) to match weight {weight.shape}")
    if x.dtype not in ACTIVATION_DTYPES or x.device != weight.device:
        raise ValueError(f"x is {x.dtype} on {x.device}; expected one of {ACTIVATION_DTYPES} on {weight.device}")
    name = resolve_backend(backend, x.device)
    count_call(name)
    if name == "cupy":
        return CupyNF4Linear.apply(x, weight)
    return F.linear(x, dequantize_nf4(weight, x.dtype))


def lora_linear_torch(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """The reference: plain torch ops, gradients by autograd. Same math and casts as the cupy path."""
    h = F.linear(x, lora_a.to(x.dtype))  # (..., r)
    return F.linear(x, weight) + scale * F.linear(h, lora_b.to(x.dtype))  # (..., O)


class CupyLoRALinear(torch.autograd.Function):
    """LoRA linear on cuBLAS (gemmEx) and CuPy RawKernels.

    Math (s = scale, W frozen, so no dW):
        h  = x Aᵀ                      (N, r)
        y  = x Wᵀ + s·h Bᵀ             (N, O)
        dH = dY B                      (N, r)   computed once, used by dA and dx
        dB = s·dYᵀ h                   (O, r)
        dA = s·dHᵀ x                   (r, K)
        dx = dY W + s·dH A             (N, K)

    GEMM plan: forward 3 (x Aᵀ; x Wᵀ; then s·h Bᵀ accumulated into y with alpha = s, beta = 1),
    backward 5 (dH; dB with alpha = s; dA with alpha = s; dY W; then s·dH A accumulated into dx with
    alpha = s, beta = 1); 3 when x needs no grad (dH, dB, dA).
    x and h are saved; x Aᵀ is never recomputed; s is always folded into a GEMM's alpha, so no
    elementwise scale or add pass touches (N, O) or (N, K) data. The only RawKernel launches are the
    explicit fp32 -> 16-bit adapter casts.
    """

    @staticmethod
    def forward(ctx, x, weight, lora_a, lora_b, scale):
        in_features = x.shape[-1]
        out_features, r = lora_b.shape
        x2 = x.reshape(-1, in_features).contiguous()  # (N, K) act
        n = x2.shape[0]
        nf4 = weight if isinstance(weight, NF4Tensor) else None
        w = dequantize_nf4(nf4, x.dtype) if nf4 is not None else weight.contiguous()  # (O, K) act (scratch if NF4)
        h = torch.empty((n, r), dtype=x.dtype, device=x.device)  # (N, r) act
        y = torch.empty((n, out_features), dtype=x.dtype, device=x.device)  # (N, O) act
        with cx.on_torch_stream(x.device) as cu:
            a_c = _to_compute_dtype(cu, lora_a, x.dtype)  # (r, K) act
            b_c = _to_compute_dtype(cu, lora_b, x.dtype)  # (O, r) act
            cu.gemm(h, x2, a_c, trans_b=True)
            cu.gemm(y, x2, w, trans_b=True)
            cu.gemm(y, h, b_c, trans_b=True, alpha=scale, beta=1.0)
        # An NF4 weight is not saved in 16 bits: the backward dequantises it again. ctx keeps a reference to
        # the NF4Tensor itself: frozen module state (like a Parameter), not an activation.
        ctx.save_for_backward(x2, h, None if nf4 is not None else w, a_c, b_c)
        ctx.nf4 = nf4
        ctx.scale = scale
        ctx.x_shape = x.shape
        ctx.adapter_dtype = lora_a.dtype
        return y.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, dy):
        x2, h, w, a_c, b_c = ctx.saved_tensors
        need_x, _, need_a, need_b, _ = ctx.needs_input_grad
        s = ctx.scale
        n, in_features = x2.shape
        out_features, r = b_c.shape
        dy2 = dy.reshape(-1, out_features).contiguous()  # (N, O) act
        dx = da = db = None
        with cx.on_torch_stream(dy2.device) as cu:
            if need_x or need_a:
                dh = torch.empty((n, r), dtype=dy2.dtype, device=dy2.device)  # (N, r) act
                cu.gemm(dh, dy2, b_c)
            if need_b:
                db = torch.empty((out_features, r), dtype=ctx.adapter_dtype, device=dy2.device)  # (O, r) adapter
                cu.gemm(db, dy2, h, trans_a=True, alpha=s)
            if need_a:
                da = torch.empty((r, in_features), dtype=ctx.adapter_dtype, device=dy2.device)  # (r, K) adapter
                cu.gemm(da, dh, x2, trans_a=True, alpha=s)
            if need_x:
                if ctx.nf4 is not None:
                    w = dequantize_nf4(ctx.nf4, dy2.dtype)  # (O, K) act, scratch freed on return
                dx = torch.empty((n, in_features), dtype=dy2.dtype, device=dy2.device)  # (N, K) act
                cu.gemm(dx, dy2, w)
                cu.gemm(dx, dh, a_c, alpha=s, beta=1.0)
                dx = dx.view(ctx.x_shape)
        return dx, None, da, db, None


class CupyNF4Linear(torch.autograd.Function):
    """Frozen NF4 linear: y = x Ŵᵀ, dx = dY Ŵ; Ŵ dequantised (RawKernel) into scratch in each pass."""

    @staticmethod
    def forward(ctx, x, weight):
        out_features, in_features = weight.shape
        x2 = x.reshape(-1, in_features).contiguous()  # (N, K) act
        w = dequantize_nf4(weight, x.dtype)  # (O, K) act scratch
        y = torch.empty((x2.shape[0], out_features), dtype=x.dtype, device=x.device)  # (N, O) act
        with cx.on_torch_stream(x.device) as cu:
            cu.gemm(y, x2, w, trans_b=True)
        ctx.nf4, ctx.x_shape = weight, x.shape
        return y.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, dy):
        if not ctx.needs_input_grad[0]:
            return None, None
        out_features, in_features = ctx.nf4.shape
        dy2 = dy.reshape(-1, out_features).contiguous()  # (N, O) act
        w = dequantize_nf4(ctx.nf4, dy2.dtype)  # (O, K) act scratch
        dx = torch.empty((dy2.shape[0], in_features), dtype=dy2.dtype, device=dy2.device)  # (N, K) act
        with cx.on_torch_stream(dy2.device) as cu:
            cu.gemm(dx, dy2, w)
        return dx.view(ctx.x_shape), None


def _to_compute_dtype(cu: cx.on_torch_stream, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, contiguous: itself when it already is, else the cast.cu RawKernel's output."""
    if t.dtype == dtype:
        return t.contiguous()
    assert t.dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16), (t.dtype, dtype)
    src = t.detach().contiguous()
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    n = src.numel()
    grid = (min(cx.ceil_div(n, _CAST_BLOCK), _CAST_MAX_GRID),)
    cu.launch("cast.cu", _CAST_KERNELS, f"cast_from_f32<{cx.CUDA_TYPE_NAME[dtype]}>", grid, (_CAST_BLOCK,),
              (src, out, n))
    return out


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
        raise ValueError(f"x has shape {tuple(x.shape)}, expected (..., {in_features}) to match weight "
                         f"{tuple(weight.shape)}")
    if lora_a.dim() != 2 or lora_a.shape[1] != in_features or lora_a.shape[0] < 1:
        raise ValueError(f"lora_a has shape {tuple(lora_a.shape)}, expected (r, {in_features}) with r >= 1")
    r = lora_a.shape[0]
    if tuple(lora_b.shape) != (out_features, r):
        raise ValueError(f"lora_b has shape {tuple(lora_b.shape)}, expected ({out_features}, {r})")
    devices = {name: t.device for name, t in (("x", x), ("weight", weight), ("lora_a", lora_a), ("lora_b", lora_b))}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all tensors must be on one device, got {', '.join(f'{k} on {v}' for k, v in devices.items())}")
    allowed = ACTIVATION_DTYPES + (REFERENCE_ONLY_DTYPES if backend == "torch" else ())
    if x.dtype not in allowed:
        raise ValueError(f"x has dtype {x.dtype}, expected one of {allowed} for backend={backend!r}")
    if not nf4 and weight.dtype != x.dtype:
        raise ValueError(f"weight has dtype {weight.dtype} but x has {x.dtype}; they must match "
                         "(or run under torch.autocast)")
    if lora_a.dtype != lora_b.dtype:
        raise ValueError(f"lora_a has dtype {lora_a.dtype} but lora_b has {lora_b.dtype}; they must match")
    adapter_ok = (x.dtype,) + ((torch.float32,) if x.dtype in (torch.float16, torch.bfloat16) else ())
    if lora_a.dtype not in adapter_ok:
        raise ValueError(f"adapters have dtype {lora_a.dtype}, expected {' or '.join(map(str, adapter_ok))} "
                         f"for x of dtype {x.dtype}")
    if not nf4 and weight.requires_grad:
        raise ValueError("weight requires grad, but the LoRA base weight is frozen and never gets a gradient; "
                         "call weight.requires_grad_(False) (or pass weight.detach())")
    if isinstance(scale, torch.Tensor) or not isinstance(scale, Real) or not math.isfinite(float(scale)):
        raise ValueError(f"scale={scale!r} must be a finite Python number (alpha / r)")
