"""Every designed path through lora_core's RawKernels, one parity case each (``lora_core.ops.kernel_variants``).

A launcher chooses among its kernel's variants (the SwiGLU's 16-byte vectors or scalar loads, the casts' one pass
or grid-stride loop, the NF4 dequantisation's three absmax forms, a full or partial last thread block). For each
variant in ``kernel_variants.DESIGNED`` this builds inputs of the class that must take it, runs the launcher,
checks its output against a reference, and asserts that the launch took that variant and no other. A variant the
launchers no longer reach, or reach from the wrong inputs, fails here by name; the run report lists every variant
reached (the session's "RawKernel variants reached" table).

References: the SwiGLU against float64 with an elementwise bound (each output is computed in fp32 and rounded once
to T: |got − ref| ≤ 2·u_T·|ref| + 2⁻¹⁷·m + u_T·tiny_T, m the magnitude of the product's terms; 2⁻¹⁷ covers fp32
arithmetic and the fast exp/reciprocal intrinsics, about 2⁻²¹ each; u_T·tiny_T is half the spacing of T's
subnormals), so an element left unwritten or read from the wrong
place fails even when it is small; the casts against torch's ``.to`` and the NF4 kernels against the torch
reference (``lora_core.nf4``), bit for bit.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lora_core.nf4 import dequantize_nf4, dequantize_nf4_reference, quantize_nf4, quantize_nf4_reference
from lora_core.ops import cupy_interop as cx
from lora_core.ops import cupy_lora
from lora_core.ops import fused_engine as fe
from lora_core.ops import kernel_variants as kv
from lora_core.ops import linear_cross_entropy as lce
from lora_suite.judges.parity import UNIT_ROUNDOFF

pytestmark = [pytest.mark.gpu, pytest.mark.quick, pytest.mark.needs_feature("lora_core_ops")]

DEV = "cuda"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ROWS = 37


def _randn(shape, gen, dtype=torch.float32):
    return torch.randn(shape, device=DEV, generator=gen).to(dtype)


def _poisoned(numel: int, dtype) -> None:
    """Leave a NaN-filled block of ``numel`` elements free in torch's caching allocator: the next allocation of that
    size reuses it, so an output element the kernel never writes reads back as NaN, not as a lucky zero."""
    torch.full((numel,), float("nan"), dtype=dtype, device=DEV)


# ---------------------------------------------------------------------------------------------
# SwiGLU: the row width I decides the vector width
def _inter(variant: str, width: int) -> int:
    residue = variant.split(", ", 1)[1]
    if residue == "I odd":
        return 1001
    return 1024 + int(residue.split("=")[1])  # I % width = the residue named (1024 is a multiple of 8)


def _swiglu_bound(terms: torch.Tensor, ref: torch.Tensor, dtype) -> torch.Tensor:
    # the last term: half the spacing of T's subnormals (fp16's start below 6.1e-5), where relative bounds end
    return 2 * UNIT_ROUNDOFF[dtype] * ref.abs() + 2.0**-17 * terms + torch.finfo(dtype).tiny * UNIT_ROUNDOFF[dtype]


def _swiglu_failures(names, gots, refs, terms, dtype) -> list[str]:
    out = []
    for name, got, ref, m in zip(names, gots, refs, terms):
        err = (got.double() - ref).abs().nan_to_num(nan=float("inf"))
        bad = err > _swiglu_bound(m, ref, dtype)
        if bad.any():
            i = int(bad.flatten().nonzero()[0])
            out.append(
                f"{name}: {int(bad.sum())} element(s) beyond bound, first flat index {i}: "
                f"got {float(got.flatten()[i]):.6g}, float64 {float(ref.flatten()[i]):.6g}"
            )
    return out


def _gate_terms(g: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds on the magnitudes of the terms fp32 sums in f(g) and f'(g) (the 2⁻¹⁷·m term of the bound): SiLU's
    |g σ| and σ(1 + |g|(1 − σ)); the tanh GELU's |g| (|1 + t| ≤ 2) and 1 + |g|(1 + 3·0.044715·g²)·√(2/π)."""
    if activation == "silu":
        sig = torch.sigmoid(g)
        return (g * sig).abs(), sig * (1 + g.abs() * (1 - sig))
    return g.abs(), 1 + g.abs() * (1 + 3 * 0.044715 * g * g) * math.sqrt(2 / math.pi)


def _swiglu(v: kv.Variant, gen) -> list[str]:
    """SwiGLU's and GeGLU's kernels (one launcher, the gate activation f apart), against f and f' in float64
    (``fused_engine.activation_parts``)."""
    dtype = DTYPES[v.dtype]
    activation = "silu" if v.kernel.startswith("swiglu") else "gelu_tanh"
    inter = _inter(v.variant, kv.SWIGLU_VEC_WIDTH[v.dtype])
    gu = _randn((ROWS, 2 * inter), gen, dtype) * 2
    g, u = gu[:, :inter].double(), gu[:, inter:].double()
    f, df = fe.activation_parts(g, activation)
    f_terms, df_terms = _gate_terms(g, activation)
    with cx.on_torch_stream(gu.device) as eng:
        if v.kernel.endswith("_forward"):
            _poisoned(ROWS * inter, dtype)
            act = fe.swiglu_forward(eng, gu, activation)
            torch.cuda.synchronize()
            return _swiglu_failures(("act",), (act,), (f * u,), ((f_terms * u).abs(),), dtype)
        dact = _randn((ROWS, inter), gen, dtype)
        d = dact.double()
        fe.swiglu_backward_(eng, dact, gu, activation)
        torch.cuda.synchronize()
    refs = (d * u * df, d * f, f * u)
    terms = ((d * u).abs() * df_terms, (d * f_terms).abs(), (f_terms * u).abs())
    return _swiglu_failures(("dg", "du", "act"), (gu[:, :inter], gu[:, inter:], dact), refs, terms, dtype)


# ---------------------------------------------------------------------------------------------
# The fp32 -> 16-bit casts: the element count decides one pass or a grid-stride loop
def _bitwise(names, gots, wants) -> list[str]:
    return [
        f"{n}: {int((got != want).sum())} of {want.numel()} element(s) differ"
        for n, got, want in zip(names, gots, wants)
        if got.shape != want.shape or not torch.equal(got, want)
    ]


def _cast_pair(v: kv.Variant, gen) -> list[str]:
    dtype = DTYPES[v.dtype]
    r, k, o = (16, 333, 1001) if v.variant == "one pass" else (64, 16384, 1001)  # 1.11 M > 4096·256 elements
    a, b = _randn((r, k), gen), _randn((o, r), gen)
    _poisoned(a.numel() + b.numel(), dtype)
    with cx.on_torch_stream(a.device) as cu:
        a_c, b_c = cupy_lora.adapters_in(cu, a, b, dtype)
    return _bitwise(("A", "B"), (a_c, b_c), (a.to(dtype), b.to(dtype)))


def _cast_stack(v: kv.Variant, gen) -> list[str]:
    dtype = DTYPES[v.dtype]
    if v.variant.startswith("padded"):
        shapes = [(16, 333), (1001, 16), (7, 5)]
    elif v.variant.endswith("grid-stride"):
        shapes = [(64, 6000)] * 6  # 2.3 M > 8192·256 elements
    else:
        shapes = [(16, 333), (16, 333), (1001, 16), (1001, 16), (16, 1001), (333, 16)]
    srcs = [_randn(s, gen) for s in shapes]
    _poisoned(sum(t.numel() for t in srcs), dtype)
    with cx.on_torch_stream(srcs[0].device) as eng:
        got = fe.stack_cast(eng, srcs, dtype)
    return _bitwise(("stacked",), (got,), (torch.cat([t.reshape(-1).to(dtype) for t in srcs]),))


# ---------------------------------------------------------------------------------------------
# NF4: the block counts decide full or partial last thread blocks; the state decides the absmax form
def _weight(v: kv.Variant, gen, full_rows: int) -> torch.Tensor:
    rows = full_rows if "full last CTA" in v.variant else 333  # 333 blocks of 64: no power of two divides it
    return _randn((rows, 64), gen, DTYPES[v.dtype]) * 3


def _nf4_quantize(v: kv.Variant, gen) -> list[str]:
    w = _weight(v, gen, full_rows=512)  # 512 blocks: 64 CTAs of 8 warps
    got, ref = quantize_nf4(w, double_quant=False), quantize_nf4_reference(w, double_quant=False)
    return _bitwise(("packed", "absmax"), (got.packed, got.absmax), (ref.packed, ref.absmax))


def _absmax_quantize(v: kv.Variant, gen) -> list[str]:
    w = _weight(dataclasses.replace(v, dtype="bf16"), gen, full_rows=512)  # 512 absmaxes: 2 CTAs of 256
    got, ref = quantize_nf4(w, double_quant=True), quantize_nf4_reference(w, double_quant=True)
    return _bitwise(("absmax_q", "absmax_scale"), (got.absmax_q, got.absmax_scale), (ref.absmax_q, ref.absmax_scale))


def _nf4_dequantize(v: kv.Variant, gen) -> list[str]:
    dtype = DTYPES[v.dtype]
    w = _weight(v, gen, full_rows=256)  # 256·64/8 = 2048 work items: 2 CTAs of 256 threads × 4 items
    form = v.variant.split(",")[0].removeprefix("absmax=")
    q = quantize_nf4_reference(w, double_quant=form != "fp32")
    if form == "dcode":  # bitsandbytes' form: uint8 indices into a 256-entry map, scaled, plus an offset
        assert q.absmax_q is not None  # form != "fp32": double-quantised
        dmap = torch.sort(torch.rand(256, device=DEV, generator=gen) * 2 - 1).values
        idx = torch.randint(0, 256, q.absmax_q.shape, device=DEV, generator=gen, dtype=torch.uint8)
        q = dataclasses.replace(q, absmax_q=idx, absmax_code=dmap)
    _poisoned(q.numel, dtype)
    got = dequantize_nf4(q, dtype)
    return _bitwise(("weight",), (got,), (dequantize_nf4_reference(q, dtype),))


# ---------------------------------------------------------------------------------------------
# The cross-entropy rows: V decides one pass (V ≤ the block's 256 threads) or a strided loop
def _cross_entropy(v: kv.Variant, gen) -> list[str]:
    """Loss rows and dz against float64 from the same logits: dz is rounded once to T (2·u_T·|ref|), the rest is
    fp32 arithmetic over V terms and the fast exp (2⁻¹⁵ of the row's scale covers both with room); ignored rows 0."""
    dtype, vec = DTYPES[v.dtype], int(v.variant.split(",")[0].removeprefix("VEC="))
    one_pass = ", one pass" in v.variant  # V / VEC within one block of 256 threads, or a loop; V odd for VEC = 1
    vocab = (200 if one_pass else 8192) if vec > 1 else (201 if one_pass else 1001)
    cap = 4.0 if v.variant.endswith("softcap") else 0.0  # a cap below the logits' range: it bends them
    z = _randn((ROWS, vocab), gen, dtype) * 3
    t = torch.randint(0, vocab, (ROWS,), device=DEV, generator=gen)
    t[::5] = -100
    zd, kept = z.double(), t != -100
    chain = torch.ones_like(zd)
    if cap:
        zd = cap * torch.tanh(zd / cap)
        chain = 1 - (zd / cap) ** 2
    lse, picked = torch.logsumexp(zd, -1), torch.where(kept, t, 0)
    loss_ref = torch.where(kept, lse - zd[torch.arange(ROWS, device=DEV), picked], 0.0)
    dz_ref = torch.exp(zd - lse[:, None])
    dz_ref[torch.arange(ROWS, device=DEV), picked] -= 1
    dz_ref = dz_ref * kept[:, None] * chain
    _poisoned(ROWS, torch.float32)
    loss = torch.empty(ROWS, device=DEV)
    with cx.on_torch_stream(z.device) as eng:
        lce.ce_rows_(eng, z, t, loss, -100, cap)
    torch.cuda.synchronize()
    out = []
    for name, got, ref, bound in (
        ("dz", z, dz_ref, 2 * UNIT_ROUNDOFF[dtype] * dz_ref.abs() + 2.0**-15),
        ("loss rows", loss, loss_ref, 2.0**-15 * (lse.abs() + 1)),
    ):
        bad = (got.double() - ref).abs().nan_to_num(nan=float("inf")) > bound
        if bad.any():
            out.append(f"{name}: {int(bad.sum())} element(s) beyond bound")
    return out


CASES = {
    "cross_entropy_rows": _cross_entropy,
    "swiglu_forward": _swiglu,
    "swiglu_backward_inplace": _swiglu,
    "geglu_forward": _swiglu,
    "geglu_backward_inplace": _swiglu,
    "cast_pair_from_f32": _cast_pair,
    "cast_stack_from_f32": _cast_stack,
    "nf4_quantize": _nf4_quantize,
    "absmax_quantize": _absmax_quantize,
    "nf4_dequantize": _nf4_dequantize,
}


def _id(v: kv.Variant) -> str:
    return f"{v.kernel}-{v.dtype}-{v.variant}".replace(", ", "-").replace(" ", "_")


@pytest.mark.parametrize("variant", kv.DESIGNED, ids=_id)
def test_designed_variant_is_taken_and_matches_its_reference(variant, check):
    gen = torch.Generator(device=DEV).manual_seed(2031)
    before = kv.reached()
    failures = CASES[variant.kernel](variant, gen)
    same_kernel = [v for v in kv.reached_since(before) if (v.kernel, v.dtype) == (variant.kernel, variant.dtype)]
    taken = " + ".join(sorted(v.variant for v in same_kernel)) or "(none)"
    what = f"{variant.kernel} {variant.dtype}"
    check(f"{what}: the variant its case took", taken, "==", variant.variant, source="lora_core.ops.kernel_variants")
    check(f"{what}: outputs beyond the reference's bound", len(failures), "==", 0, detail="; ".join(failures[:3]))
