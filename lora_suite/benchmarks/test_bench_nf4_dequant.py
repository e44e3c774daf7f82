"""Issue 47's second lever, measured before it is built: NF4 dequantisation run beside other work.

At the full tier's 512 tokens a frozen 7B base GEMM is compute-bound (about 512 FLOP per byte of Ŵ) and the
dequantisation is memory-bound (0.5 byte read, 2 bytes written per element); between the GEMMs of a decoder
layer run small kernels (rank-8 LoRA products, attention, norms, SwiGLU) that leave most of the GPU idle. A second
stream could dequantise base i+1 while the GEMM on base i and the work after it run.

    serial                  per base: dequantise Ŵ_i, its GEMM y_i = x Ŵ_iᵀ, the work after it; one stream
                            (what lora_core runs)
    prefetch, joined after the GEMM      Ŵ_{i+1} dequantised on a side stream beside GEMM i only
    prefetch, joined at the next base    beside GEMM i and the work after it, until base i+1's GEMM waits for it
    ..., GEMMs first        the same, captured on a stream of the greatest priority (the side stream keeps the
                            default, lowest one), so the main stream's blocks are scheduled first
    no dequantisation       the same sequence on bases already in bf16: the floor a prefetch can reach
    dequantise alone        the dequantisations alone

Workload: two Llama-2-7B decoder layers' bases in a forward's order (q, k, v, o, gate, up, down), x of 512 tokens,
the work between GEMMs as ``_small_work`` lists; each candidate a CUDA graph of the sequence, the graphs replayed
in turns over ``ROUNDS`` rounds. The check: every prefetch candidate's outputs equal the serial ones bit for bit.
Run: ``lora-suite bench -- -k nf4_dequant``.
"""

from __future__ import annotations

import pytest
import torch

from lora_core.nf4 import dequantize_nf4, quantize_nf4
from lora_suite.measure.round_spread import Spread
from lora_suite.measure.timing import interleaved_rounds

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark, pytest.mark.needs_feature("lora_core_ops")]

TOKENS, LAYERS, ROUNDS = 512, 2, 7
LAYER = ((4096, 4096),) * 4 + ((11008, 4096), (11008, 4096), (4096, 11008))  # (N, K): q, k, v, o, gate, up, down
TABLE = "NF4 dequantisation beside a decoder layer's other work (device ms per sequence, 512 tokens)"
COLUMNS = ("candidate", "bases", "ms per sequence", "ms min", "ms max", "rounds", "ratio to serial")


def _graph(fn, stream=None):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph.replay


def _small_work(xs, ys):
    """What runs between two base GEMMs of a decoder layer's forward, by the index of the base it follows: each
    base's rank-8 LoRA products, the attention after v, the residual add and RMS norm after o and down, the SwiGLU
    product after up (torch ops on the layer's shapes: kernels that leave most of the GPU idle)."""
    x, a = xs[4096], torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    h, b = torch.empty(TOKENS, 8, device="cuda", dtype=torch.bfloat16), torch.zeros(4096, 8, device="cuda").bfloat16()
    res = torch.empty_like(x)

    def lora(i):
        torch.mm(x, a.T, out=h)
        ys[i][:, :4096].addmm_(h, b.T)

    def norm():
        torch.add(x, ys[3][:, :4096], out=res)
        res.mul_(torch.rsqrt(res.float().pow(2).mean(-1, keepdim=True) + 1e-5).bfloat16())

    def attention():
        q, k, v = (ys[j].view(TOKENS, 32, 128).transpose(0, 1).unsqueeze(0) for j in range(3))
        torch.nn.functional.scaled_dot_product_attention(q * 1.0, k * 1.0, v, is_causal=True)

    def swiglu():
        torch.nn.functional.silu(ys[4]).mul_(ys[5])

    extra = {2: attention, 3: norm, 5: swiglu, 6: norm}

    def after(i):
        lora(i)
        if i % len(LAYER) in extra:
            extra[i % len(LAYER)]()

    return after


def _sequences(qs, xs, ys, after):
    """The candidates' callables over bases ``qs``, inputs ``xs`` (by K), outputs ``ys`` and the work ``after``
    each base's GEMM."""
    width = max(q.numel for q in qs)
    bufs = [torch.empty(width, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    dense = [dequantize_nf4(q, torch.bfloat16) for q in qs]
    side = torch.cuda.Stream()

    def view(i):
        return bufs[i % 2][: qs[i].numel].view(qs[i].shape)

    def gemm(i, w):
        torch.mm(xs[qs[i].shape[1]], w.T, out=ys[i])

    def serial():
        for i, q in enumerate(qs):
            gemm(i, dequantize_nf4(q, torch.bfloat16, out=view(i)))
            after(i)

    def prefetch(join_late: bool):
        main = torch.cuda.current_stream()
        dequantize_nf4(qs[0], torch.bfloat16, out=view(0))
        done = None
        for i in range(len(qs)):
            if done is not None:
                main.wait_event(done)  # Ŵ_i, made on the side stream, is ready
                done = None
            if i + 1 < len(qs):
                side.wait_stream(main)  # Ŵ_{i-1}'s GEMM, which read buffer (i+1) % 2, is done
                with torch.cuda.stream(side):
                    dequantize_nf4(qs[i + 1], torch.bfloat16, out=view(i + 1))
                done = torch.cuda.Event()
                done.record(side)
            gemm(i, view(i))
            if not join_late and done is not None:
                main.wait_event(done)
                done = None
            after(i)

    def gemms():
        for i in range(len(qs)):
            gemm(i, dense[i])
            after(i)

    def dequants():
        for i, q in enumerate(qs):
            dequantize_nf4(q, torch.bfloat16, out=view(i))

    return {
        "serial": serial,
        "prefetch, joined after the GEMM": lambda: prefetch(False),
        "prefetch, joined at the next base": lambda: prefetch(True),
        "prefetch, joined at the next base, GEMMs first": lambda: prefetch(True),
        "no dequantisation (bases in bf16)": gemms,
        "dequantise alone": dequants,
    }


def test_dequant_overlap_against_serial(run_report, check):
    gen = torch.Generator(device="cuda").manual_seed(0)
    qs = [quantize_nf4((torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()) for n, k in LAYER * LAYERS]
    xs = {k: torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16, generator=gen) for k in {4096, 11008}}
    ys = [torch.zeros(TOKENS, q.shape[0], dtype=torch.bfloat16, device="cuda") for q in qs]
    _low, high = torch.cuda.current_stream().priority_range()  # a static method; torch's stub types it per stream
    fns = _sequences(qs, xs, ys, _small_work(xs, ys))
    first = {"prefetch, joined at the next base, GEMMs first": torch.cuda.Stream(priority=high)}
    with torch.no_grad():
        fns["serial"]()
        want = [y.clone() for y in ys]
        for name in [n for n in fns if n.startswith("prefetch")]:
            for y in ys:
                y.zero_()
            fns[name]()
            torch.cuda.synchronize()
            same = sum(int(torch.equal(a, b)) for a, b in zip(ys, want))
            check(f"{name}: outputs equal to serial's bit for bit", same, "==", len(ys))
        graphs = {name: _graph(fn, first.get(name)) for name, fn in fns.items()}
        ms = interleaved_rounds(graphs, rounds=ROUNDS, reps=5, warmup=2)
    base = Spread.of(ms["serial"])
    assert base is not None  # interleaved_rounds times each callable ROUNDS (> 0) times
    for name, times in ms.items():
        s = Spread.of(times)
        assert s is not None  # likewise
        cells = (round(s.median, 4), round(s.low, 4), round(s.high, 4), s.rounds, round(s.median / base.median, 3))
        run_report.add_row("benchmarks", TABLE, COLUMNS, (name, len(qs), *cells))
