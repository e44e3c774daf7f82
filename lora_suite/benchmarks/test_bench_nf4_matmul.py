"""Issue 47's lever, measured: NF4 dequantised inside the GEMM's operand load (``lora_core.ops.nf4_matmul``, Triton)
against what lora_core runs, dequantise into bf16 scratch then cuBLAS, at the full tier's 7B shapes (512 tokens).

Per shape, each candidate is captured in a CUDA graph of ``CALLS`` back-to-back calls (host launch costs out: every
figure is device time per call), and the graphs are replayed in turns over ``ROUNDS`` rounds
(``lora_suite.measure.timing.interleaved_rounds``); each figure is the median of the rounds with its least and
greatest round. Candidates:

    dequantise + cuBLAS          lora_core's frozen NF4 linear forward (``CupyNF4Linear``): RawKernel, then gemmEx
    dequantise alone             the RawKernel into a preallocated bf16 scratch
    cuBLAS alone                 the GEMM on Ŵ already in bf16 (what the first two cost without the dequantisation)
    nf4_matmul <config>          the mixed-input kernel, each of ``CONFIGS`` (lora_core's ``CONFIG`` first)
    timing bound, no lookup      the kernel with its code lookup left out (wrong values): what the tile's unpacking
                                 and the bf16 operand's trip through shared memory cost before any lookup
    weight first <config>[ split]  ``weight_first_matmul``: yᵀ = Ŵ xᵀ, the unpacked tile as the product's first
                                 operand (read from registers on Hopper), each of ``WEIGHT_FIRST``, one product of
                                 64 columns or (split) two of 32; a configuration Triton cannot compile is a row

The ratio column is each candidate's time over dequantise + cuBLAS: below 1 the lever pays at that shape. One
check per kernel form: it computes the product the dequantise + cuBLAS path computes (within the bf16 GEMM bound).
Run: ``lora-suite bench -- -k nf4_matmul``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch

from lora_core.nf4 import dequantize_nf4, quantize_nf4
from lora_core.ops.nf4_matmul import CONFIG, WEIGHT_FIRST_CONFIG
from lora_suite.judges.parity import compare, tolerance
from lora_suite.measure.round_spread import Spread
from lora_suite.measure.timing import interleaved_rounds

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark, pytest.mark.needs_feature("lora_core_ops")]

TOKENS = 512  # the full tier's batch: 1 x 512
SHAPES = {  # (N, K) of the full tier's Llama-2-7B linears
    "q/k/v/o 4096x4096": (4096, 4096),
    "gate/up 11008x4096": (11008, 4096),
    "down 4096x11008": (4096, 11008),
}
CALLS, ROUNDS = 20, 7
# (BM, BN, GROUP_M, num_warps, num_stages) tried; lora_core's CONFIG first (the fastest of a wider search on an H100)
CONFIGS = (CONFIG, (128, 128, 8, 8, 3), (256, 128, 8, 8, 3), (512, 64, 1, 8, 3))
# (BN, BM, num_warps, num_stages) of weight_first_matmul; lora_core's WEIGHT_FIRST_CONFIG first
WEIGHT_FIRST = (WEIGHT_FIRST_CONFIG, (128, 256, 8, 3), (128, 128, 8, 3), (128, 128, 4, 4), (256, 128, 8, 3))
BASE = "dequantise + cuBLAS"
TABLE = "NF4 mixed-input GEMM against dequantise + cuBLAS (device ms per call, 512 tokens)"
COLUMNS = ("shape", "candidate", "ms per call", "ms min", "ms max", "rounds", "ratio to dequantise + cuBLAS")


def captured(fn, calls: int = CALLS):
    """A callable replaying ``calls`` calls of ``fn`` captured in one CUDA graph (``fn`` warmed up first)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def candidates(x, q):
    from lora_core.ops import nf4_matmul as NM
    from lora_core.ops.lora_linear import CupyNF4Linear

    scratch = dequantize_nf4(q, torch.bfloat16)
    y = torch.empty(x.shape[0], q.shape[0], dtype=torch.bfloat16, device=x.device)
    fns: dict[str, Callable[[], object]] = {
        BASE: lambda: CupyNF4Linear.apply(x, q),
        "dequantise alone": lambda: dequantize_nf4(q, torch.bfloat16, out=scratch),
        "cuBLAS alone": lambda: torch.mm(x, scratch.T, out=y),
    }
    for config in CONFIGS:
        fns[f"nf4_matmul {config}"] = partial(NM.nf4_matmul, x, q, out=y, config=config)
    fns["timing bound, no lookup"] = lambda: NM.bound_matmul(x, q, out=y)
    for wf_config in WEIGHT_FIRST:
        for split in (False, True):
            name = f"weight first {wf_config}{' split' if split else ''}"
            fns[name] = partial(NM.weight_first_matmul, x, q, out=y, config=wf_config, split=split)
    return fns


@pytest.mark.parametrize("shape", list(SHAPES))
def test_nf4_matmul_against_dequantise_then_cublas(shape, run_report, check):
    pytest.importorskip("triton", reason="lora_core.ops.nf4_matmul is a Triton kernel; triton is not installed")
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from lora_core.ops.nf4_matmul import nf4_matmul

    COMPILE_ERRORS = (CompilationError, OutOfResources)
    n, k = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = quantize_nf4((torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16())
    x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = x.double() @ dequantize_nf4(q, torch.bfloat16).double().T
    e = compare("y", nf4_matmul(x, q), ref, tolerance(torch.bfloat16, k))
    check(f"{shape}: nf4_matmul's y max err / max ref (float64)", e.scaled_err, "<=", e.tol, detail=e.describe())
    with torch.no_grad():
        graphs = {}
        for name, fn in candidates(x, q).items():
            try:
                got = fn()
            except COMPILE_ERRORS as exc:  # a configuration Triton cannot compile is a row, not the end of the table
                run_report.add_row("benchmarks", TABLE, COLUMNS, (shape, name, f"failed: {exc!r}"[:200], "", "", 0, ""))
                continue
            if name.startswith("weight first"):
                e = compare("y", got, ref, tolerance(torch.bfloat16, k))
                check(f"{shape}: {name} y max err / max ref", e.scaled_err, "<=", e.tol, detail=e.describe())
            graphs[name] = captured(fn)
        ms = interleaved_rounds(graphs, rounds=ROUNDS, reps=3, warmup=2)
    per_call = {name: [t / CALLS for t in times] for name, times in ms.items()}
    base = Spread.of(per_call[BASE])
    assert base is not None  # interleaved_rounds times each callable ROUNDS (> 0) times
    for name, times in per_call.items():
        s = Spread.of(times)
        assert s is not None  # likewise
        cells = (round(s.median, 4), round(s.low, 4), round(s.high, 4), s.rounds, round(s.median / base.median, 3))
        run_report.add_row("benchmarks", TABLE, COLUMNS, (shape, name, *cells))
