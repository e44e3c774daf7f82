"""GPU parity of lora_core's fused linear cross-entropy (``lora_core.ops.linear_cross_entropy``) on the cupy engine:
the loss and the gradients of the hidden states and of a trainable head against float64 over dtypes, 2-D / 3-D /
non-contiguous hidden states, vocabularies wider and narrower than a thread block, chunkings with a partial last
chunk, ignored tokens and Gemma 2's logit soft cap; a captured replay bitwise equal to eager.

Reference: PyTorch's cross-entropy over the float64 logits h Wᵀ (materialised), by autograd, independent of the fused
code. Tolerance: ``STAGES · tolerance(dtype, k)``, k the largest inner dimension (d for the logits, V for dh, N for
dW), 3 stages as for the fused MLP: the logits rounded to the dtype, dz rounded to it, and the GEMM's output. A
dropped ``[j = t]`` term or a mean over every token instead of the labelled ones gives errors of order 1 or of the
ignored fraction (selftest-gpu plants both).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from lora_core.ops import kernel_variants as kv
from lora_core.ops.linear_cross_entropy import linear_cross_entropy
from lora_suite.harness.parity_grid import report_grid
from lora_suite.judges.parity import MLP_STAGES as STAGES
from lora_suite.judges.parity import compare, tolerance

pytestmark = [pytest.mark.gpu, pytest.mark.quick, pytest.mark.needs_feature("lora_core_ops")]

DEV = "cuda"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = ((576, 49152), (333, 1001), (64, 200))  # (d, V): SmolLM2's head, odd widths, V within one thread block
N_TOKENS = (1, 37, 2048)
CHUNKS = (None, 7)  # the default (one chunk at these N), and 7 rows: many chunks, the last one partial
NAMES = ("loss", "dh", "dW")
SOFTCAP = 2.0  # below the unit-variance logits' range (|z| up to ~5), so the cap bends them (Gemma 2 ships 30)


def loss_case(n, d, vocab, dtype, layout, gen):
    """(hidden, head, targets): unit-variance hidden states, a 1/√d head, a third of the targets ignored (never the
    first)."""
    w = (torch.randn((vocab, d), device=DEV, generator=gen) / math.sqrt(d)).to(dtype)
    if layout == "noncontig":
        h = torch.randn((n, 2 * d), device=DEV, generator=gen).to(dtype)[:, ::2]
    else:
        h = torch.randn((n, d), device=DEV, generator=gen).to(dtype)
    t = torch.randint(0, vocab, (n,), device=DEV, generator=gen)
    t[torch.rand(n, device=DEV, generator=gen) < 1 / 3] = -100
    t[0] = t[0].clamp_min(0)  # one labelled token at least (a batch with none has the loss 0/0 = NaN)
    if layout == "3d" and n % 2 == 0:
        h, t = h.view(2, n // 2, d), t.view(2, n // 2)
    return h, w, t


def loss_and_grads(fn, h, w, t, train_head: bool, upstream: float = 1.5):
    """(loss, dh, dW or None) of ``fn(h, w, t)`` for an upstream gradient ``upstream`` (not 1: the backward scales
    what the forward computed)."""
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(train_head)
    loss = fn(h, w, t)
    grads = torch.autograd.grad(loss * upstream if upstream != 1 else loss, [h, w] if train_head else [h])
    return [loss.detach(), *grads] + ([] if train_head else [None])


def fused(h, w, t, train_head=False, chunk=None, upstream=1.5, softcap=None):
    fn = lambda h, w, t: linear_cross_entropy(h, w, t, chunk_rows=chunk, softcap=softcap, backend="cupy")  # noqa: E731
    return loss_and_grads(fn, h, w, t, train_head, upstream)


def reference(h, w, t, train_head=False, softcap=None):
    def fn(h, w, t):
        z = (h @ w.t()).reshape(-1, w.shape[0])
        z = z if softcap is None else softcap * torch.tanh(z / softcap)
        return F.cross_entropy(z, t.reshape(-1), ignore_index=-100)

    return loss_and_grads(fn, h.double(), w.double(), t, train_head)


def judge(got, want, dtype, n, d, vocab):
    ks = (d, vocab, max(n, 1))
    pairs = zip(NAMES, got, want, ks)
    return [compare(name, g, r, STAGES * tolerance(dtype, k)) for name, g, r, k in pairs if r is not None]


@pytest.mark.parametrize("layout", ["2d", "3d", "noncontig"])
@pytest.mark.parametrize("config", list(DTYPES))
def test_fused_loss_matches_float64(config, layout, run_report, check):
    dtype = DTYPES[config]
    gen = torch.Generator(device=DEV).manual_seed(2032)
    cases, before = [], kv.reached()
    for n, (d, vocab), chunk in itertools.product(N_TOKENS, SHAPES, CHUNKS):
        train_head = chunk is not None  # the head's gradient on the chunked runs (dW accumulates over chunks)
        cap = SOFTCAP if chunk is not None and vocab > 256 else None  # Gemma 2's cap, on the strided rows
        h, w, t = loss_case(n, d, vocab, dtype, layout, gen)
        got, want = fused(h, w, t, train_head, chunk, softcap=cap), reference(h, w, t, train_head, softcap=cap)
        label = f"N={n} d={d} V={vocab} chunk={chunk or 'default'}" + (f" softcap={cap}" if cap else "")
        cases.append((label, judge(got, want, dtype, n, d, vocab)))
    rule = f"tol = {STAGES}·8·(u_dtype + u_fp32·√k); lora_suite/tiers/quick/test_fused_loss_parity.py"
    report_grid(run_report, check, cases, ("loss", config, layout), rule, "linear cross-entropy", "hidden")
    taken = {v.variant for v in kv.reached_since(before) if v.kernel == "cross_entropy_rows" and v.dtype == config}
    check(
        f"fused loss {config} {layout}: cross-entropy variants reached",
        " + ".join(sorted(taken)),
        "==",
        " + ".join(sorted(_designed_ce_variants(config))),
        source="kernels/cross_entropy.cu: one block of 256 threads per row, 16-byte vectors where V is a multiple of "
        "their width; V = 200 fits one pass, 1001 (scalar) and 49152 loop; the soft cap's branch on the chunked runs",
    )


def _designed_ce_variants(config: str) -> set[str]:
    """The cross-entropy variants the grid's vocabularies must take (the rule cross_entropy.cu is built for, restated
    here): VEC = the 16-byte width where V is a multiple of it, else 1; one pass where V / VEC fits 256 threads; the
    soft cap on the vocabularies the grid caps (V > 256)."""
    width, out = kv.SWIGLU_VEC_WIDTH[config], set()
    for _, vocab in SHAPES:
        vec = width if vocab % width == 0 else 1
        out.add(f"VEC={vec}, " + ("one pass" if vocab // vec <= 256 else "grid-stride"))
        if vocab > 256:
            out.add(f"VEC={vec}, grid-stride, softcap")
    return out


def test_a_captured_loss_replays_bitwise_equal_to_eager(check):
    """Forward and backward of the fused loss captured in a CUDA graph, replayed on two new batches copied into its
    static inputs: the loss and dh equal an eager run's bit for bit (the count of labelled tokens is read on the
    device, so each replay uses its own batch's)."""
    gen = torch.Generator(device=DEV).manual_seed(2033)
    batches = [loss_case(512, 576, 49152, torch.bfloat16, "2d", gen) for _ in range(3)]
    h_s, w, t_s = (x.clone() for x in batches[0])
    h_s.requires_grad_(True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph: compiles the kernel, sets up cuBLAS
        linear_cross_entropy(h_s, w, t_s, chunk_rows=100, backend="cupy").backward()
    torch.cuda.current_stream().wait_stream(stream)
    h_s.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss_s = linear_cross_entropy(h_s, w, t_s, chunk_rows=100, backend="cupy")
        (dh_s,) = torch.autograd.grad(loss_s, [h_s])
    mismatches = []
    for i, (h, _, t) in enumerate(batches[1:], 1):
        with torch.no_grad():
            h_s.copy_(h)
            t_s.copy_(t)
        graph.replay()
        eager_loss, eager_dh, _ = fused(h, w, t, chunk=100, upstream=1.0)
        if not torch.equal(loss_s, eager_loss) or not torch.equal(dh_s, eager_dh):
            mismatches.append(f"batch {i}: loss {float(loss_s):.6g} vs eager {float(eager_loss):.6g}")
    check(
        "fused loss: captured replays differing from eager (of 2)",
        len(mismatches),
        "==",
        0,
        detail="; ".join(mismatches),
    )
