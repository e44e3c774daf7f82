"""y = x Ŵᵀ with Ŵ dequantised from NF4 inside the GEMM's operand load (a Triton mixed-input kernel).

Shapes: x (M, K) in bf16/fp16 with row stride ``stride_xm``, W an ``NF4Tensor`` of shape (N, K), y (M, N) in x's
dtype with row stride ``stride_ym`` (a column slice of a wider output is allowed).

What it computes, per output tile (BM × BN) and K-step of BK = 64 (one NF4 block per weight row):
    a_n      = absmax of block (n·K + k0) / 64, recovered as ``lora_core.nf4`` does (fp32 multiply then add, each
               rounded: no FMA contraction, so Ŵ is bit for bit the RawKernel's dequantisation)
    Ŵ[n, k]  = rn(c[code(n, k)] · a_n) in x's dtype      c the NF4 code table, code(n, k) a nibble of the packed bytes
    acc     += x[:, k0 + 2j] Ŵ[:, k0 + 2j]ᵀ + x[:, k0 + 2j + 1] Ŵ[:, k0 + 2j + 1]ᵀ   (high nibble = even k)
    y        = acc (fp32) rounded to x's dtype
The even and odd halves of each K-step are two tensor-core products of depth 32 (x's tile split into its even and
odd columns), so the nibbles never need interleaving. Only the summation order differs from dequantise-then-cuBLAS
(both accumulate in fp32).

Memory traffic per call: the packed codes (N·K / 2 bytes) and the absmax state instead of writing and reading Ŵ in
16 bits (4·N·K bytes): the bf16 scratch and its pass over memory are gone. The price is the dequantisation's
arithmetic, repeated for every BM rows of x, and the unpacked tile's trip through shared memory before the tensor
cores read it. Measured on an H100 at the 7B shapes and 512 tokens (lora_suite/benchmarks/test_bench_nf4_matmul.py,
docs/fused.md): 2.9-3.2x slower than dequantise + cuBLAS, so no layer calls it; it is the measured answer to
whether this lever pays, kept with its checks.

Assumptions: K a multiple of 64 (every NF4 weight is), x and y 16-byte aligned with unit column stride; Triton
available (it comes with torch's CUDA wheels). Checked by tests/core/test_nf4_matmul.py (launch plan, CPU) and
lora_suite/tiers/quick/test_nf4_matmul_kernel.py (Ŵ bit for bit, and a float64 grid).
"""

from __future__ import annotations

import torch

from lora_core.nf4 import NF4Tensor

BK = 64  # one NF4 block per weight row per K-step
FORMS = {"fp32": 0, "int8": 1, "dcode": 2}  # how a block's absmax is stored (lora_core.nf4.NF4Tensor)


def absmax_form(q: NF4Tensor) -> str:
    return "fp32" if q.absmax is not None else "dcode" if q.absmax_code is not None else "int8"


# (BM, BN, GROUP_M, num_warps, num_stages): the fastest of the configurations lora_suite's benchmark
# (benchmarks/test_bench_nf4_matmul.py) tried at the 7B shapes on an H100
CONFIG = (256, 64, 8, 8, 3)


def check_operands(x: torch.Tensor, w: NF4Tensor, out: torch.Tensor | None) -> None:
    """Each error names the bad value and what was expected."""
    if not isinstance(w, NF4Tensor):
        raise ValueError(f"nf4_matmul: w must be an NF4Tensor, got {type(w).__name__}")
    if len(w.shape) != 2 or w.shape[1] % BK:
        raise ValueError(f"nf4_matmul: w has shape {w.shape}, expected 2-D (N, K) with K a multiple of {BK}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != w.shape[1] or x.stride(1) != 1:
        got = f"shape {tuple(x.shape)} stride {x.stride()}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"nf4_matmul: x has {got}, expected (M, {w.shape[1]}) with unit column stride")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nf4_matmul: x has dtype {x.dtype}, expected torch.bfloat16 or torch.float16")
    want = (x.shape[0], w.shape[0])
    if out is not None and (tuple(out.shape) != want or out.stride(1) != 1 or out.dtype != x.dtype):
        raise ValueError(
            f"nf4_matmul: out has shape {tuple(out.shape)} {out.dtype} stride {out.stride()}, expected {want} "
            f"{x.dtype} with unit column stride"
        )
    if not x.is_cuda or x.device != w.device:
        raise ValueError(f"nf4_matmul: x is on {x.device} and w on {w.device}; both must be on one CUDA device")
    if out is not None and out.device != x.device:
        raise ValueError(f"nf4_matmul: out is on {out.device}, x on {x.device}")


def _output(x, w: NF4Tensor, out) -> torch.Tensor:
    """``out`` once the operands are checked, or a new (M, N) tensor in x's dtype."""
    check_operands(x, w, out)
    return out if out is not None else torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)


def _run(kernel: str, x, w: NF4Tensor, out, tile_m: int, tile_n: int, **meta) -> torch.Tensor:
    """Launch ``nf4_matmul_kernel.<kernel>`` over (M / tile_m) × (N / tile_n) tiles with the constants ``meta``."""
    out = _output(x, w, out)
    if x.shape[0] == 0:
        return out
    (m, k), n = x.shape, w.shape[0]
    grid = (((m + tile_m - 1) // tile_m) * ((n + tile_n - 1) // tile_n),)
    from lora_core.ops import nf4_matmul_kernel  # triton: absent on CPU-only installs

    getattr(nf4_matmul_kernel, kernel)[grid](
        x, *_state(w), out, m, n, k, x.stride(0), out.stride(0), FORM=FORMS[absmax_form(w)], **meta
    )
    return out


def _launch(x, w: NF4Tensor, out, config, lookup: bool) -> torch.Tensor:
    bm, bn, group_m, warps, stages = config
    meta = {"BM": bm, "BN": bn, "GROUP_M": group_m, "LOOKUP": lookup, "num_warps": warps, "num_stages": stages}
    return _run("nf4_matmul", x, w, out, bm, bn, **meta)


def _state(w: NF4Tensor) -> tuple:
    """The kernels' weight arguments: packed codes, absmax, int8 absmax, scales, mean, dynamic map (the packed codes
    stand in as a pointer for the state the weight's form does not read)."""
    null = w.packed
    return (
        w.packed,
        w.absmax if w.absmax is not None else null,
        w.absmax_q if w.absmax_q is not None else null,
        w.absmax_scale if w.absmax_scale is not None else null,
        float(w.absmax_mean),
        w.absmax_code if w.absmax_code is not None else null,
    )


# (BN, BM, num_warps, num_stages): the fastest of the five the benchmark tries, on an H100
WEIGHT_FIRST_CONFIG = (64, 256, 4, 4)


def weight_first_matmul(x, w: NF4Tensor, out=None, config=WEIGHT_FIRST_CONFIG, split=False) -> torch.Tensor:
    """y = x Ŵᵀ computed as yᵀ = Ŵ xᵀ (``nf4_matmul_wa``): the dequantised tile as the product's first operand, which
    Hopper's tensor cores may read from registers. ``split``: two products of 32 columns, x's even and odd ones,
    instead of one of 64 on the tile's interleaved halves. Measured slower than dequantise + cuBLAS like
    ``nf4_matmul`` (docs/fused.md), so nothing in lora_core calls it; the quick tier judges it like nf4_matmul."""
    bn, bm, warps, stages = config
    meta = {"BN": bn, "BM": bm, "SPLIT": split, "num_warps": warps, "num_stages": stages}
    return _run("nf4_matmul_wa", x, w, out, bm, bn, **meta)


def nf4_matmul(x: torch.Tensor, w: NF4Tensor, out: torch.Tensor | None = None, config=CONFIG) -> torch.Tensor:
    """y = x Ŵᵀ (module docstring) into ``out`` if given (it may be a column slice of a wider row-major tensor)."""
    return _launch(x, w, out, config, lookup=True)


def bound_matmul(x: torch.Tensor, w: NF4Tensor, out: torch.Tensor | None = None, config=CONFIG) -> torch.Tensor:
    """The same kernel with the code lookup left out (the nibble stands for its value): WRONG values, a timing bound
    only, for the benchmark that asks how much of the kernel's time the lookup is. Nothing in lora_core calls it."""
    return _launch(x, w, out, config, lookup=False)
