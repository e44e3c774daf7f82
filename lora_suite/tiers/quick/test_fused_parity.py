"""GPU parity of lora_core's fused LoRA paths (``lora_core.ops.fused_mlp`` / ``fused_qkv``) on the cupy engine:
every output and gradient against float64 over dtypes and 2-D / 3-D / non-contiguous inputs, NF4 bases, captured
replays bitwise equal to eager (a whole model's fused step-0 gradients: ``test_model_gradients.py``).

Reference: the unfused layers composed by autograd in float64 (``lora_linear_torch``, F.silu), independent of
the fused code. Tolerance: ``FUSED_STAGES · tolerance(dtype, k)`` with k the largest inner dimension, where
``tolerance`` is the single LoRA op's bound (``lora_suite/judges/parity.py``), relative to max|ref| or, for the MLP,
the floor its sums' cancellation sets (``_mlp_floors``). Why 3 stages: the longest chain
(dx of the MLP) stores three rounded intermediates of its own scale, each within one op's bound: dact (the
down projection's backward), d(gu) (the SwiGLU backward, its inputs rounded) and dx (gate and up's backward);
the forward chain has two (gu, y). The random inputs are unit-variance with 1/√k weights, so each stage's scale
is comparable to the next (no amplification to budget for). A dropped SwiGLU derivative term or a q/k/v part
not accumulated gives errors of order 1 (selftest-gpu plants both).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from lora_core.nf4 import dequantize_nf4, quantize_nf4
from lora_core.ops import fused_engine as fe
from lora_core.ops import kernel_variants as kv
from lora_core.ops.fused_mlp import MLPBases, lora_mlp
from lora_core.ops.fused_qkv import QKVBases, lora_qkv
from lora_core.ops.lora_linear import lora_linear_torch
from lora_suite.harness.parity_grid import report_grid
from lora_suite.judges.parity import MLP_STAGES as FUSED_STAGES
from lora_suite.judges.parity import compare, tolerance

pytestmark = [pytest.mark.gpu, pytest.mark.quick, pytest.mark.needs_feature("lora_core_ops")]

DEV = "cuda"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPE_CONFIGS = {"fp32": (F32, F32), "bf16": (BF16, BF16), "fp16-act+fp32-adapters": (F16, F32)}
DTYPE_CONFIGS["bf16-act+fp32-adapters"] = (BF16, F32)
SCALE = 2.0
# (K, I): SmolLM2-135M (I a multiple of 8: 16-byte SwiGLU vectors), I ≡ 4 (mod 8) (scalar for 16-bit activations,
# vectors for fp32) and an odd I (scalar for all); each MLP grid asserts the SwiGLU variants it reached
MLP_SHAPES = ((576, 1536), (333, 1004), (333, 1001))
QKV_SHAPES = ((576, (576, 192, 192)), (333, (333, 64, 96)))  # (K, (O_q, O_k, O_v)): GQA widths, and odd ones
N_TOKENS = (1, 37, 2048)


def _randn(shape, dtype, gen, std=1.0):
    return (torch.randn(shape, device=DEV, generator=gen, dtype=F32) * std).to(dtype)


def _x(n, k, dtype, layout, gen):
    if layout == "3d":
        lead = (2, n // 2) if n % 2 == 0 else (1, n)
        return _randn((*lead, k), dtype, gen)
    if layout == "noncontig":
        return _randn((n, 2 * k), dtype, gen)[:, ::2]
    return _randn((n, k), dtype, gen)


def _adapter_pair(out_f, in_f, r, dtype, gen):
    return _randn((r, in_f), dtype, gen, 1 / math.sqrt(in_f)), _randn((out_f, r), dtype, gen, 1 / math.sqrt(r))


def _run(fn, x, adapters, dy):
    """Outputs and the gradients of x and every adapter for upstream gradient(s) dy."""
    x = x.detach().clone().requires_grad_(True)
    adapters = [a.detach().clone().requires_grad_(True) for a in adapters]
    out = fn(x, adapters)
    outs = out if isinstance(out, tuple) else (out,)
    dys = dy if isinstance(dy, tuple) else (dy,)
    grads = torch.autograd.grad(outs, [x, *adapters], dys)
    return [o.detach() for o in outs], list(grads)


def _mlp_case(n, k, inter, r, dtype, adapter_dtype, layout, gen):
    w_g, w_u = _randn((inter, k), dtype, gen, 1 / math.sqrt(k)), _randn((inter, k), dtype, gen, 1 / math.sqrt(k))
    w_d = _randn((k, inter), dtype, gen, 1 / math.sqrt(inter))
    adapters = [t for o, i in ((inter, k), (inter, k), (k, inter)) for t in _adapter_pair(o, i, r, adapter_dtype, gen)]
    x = _x(n, k, dtype, layout, gen)
    return x, (w_g, w_u, w_d), adapters, _randn((*x.shape[:-1], k), dtype, gen)


GATES = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}  # PyTorch's own, the reference's


def _mlp_reference(x, weights, adapters, dy, activation="silu", bias=None):
    d = [t.double() for t in weights]
    b_g, b_u, b_d = _mlp_bias_parts(bias, weights[0].shape[0])

    def fn(x, a):
        g = lora_linear_torch(x, d[0], a[0], a[1], SCALE) + b_g
        u = lora_linear_torch(x, d[1], a[2], a[3], SCALE) + b_u
        return lora_linear_torch(GATES[activation](g) * u, d[2], a[4], a[5], SCALE) + b_d

    return _run(fn, x.double(), [a.double() for a in adapters], dy.double())


def _mlp_bias_parts(bias, inter):
    """(b_g, b_u, b_d) in float64 from ``bias`` = ([b_g; b_u], b_d); zeros for None."""
    if bias is None:
        return 0.0, 0.0, 0.0
    return (*bias[0].double().split(inter), bias[1].double())


def _mlp_fused(x, weights, adapters, dy, bases=None, activation="silu", bias=None):
    b_gu, b_d = bias or (None, None)
    bases = bases or MLPBases(w_gu=torch.cat(weights[:2]), w_d=weights[2], bias_gu=b_gu, bias_d=b_d)

    def fn(x, a):
        return lora_mlp(x, bases, tuple(a), SCALE, SCALE, backend="cupy", activation=activation)

    return _run(fn, x, adapters, dy)


def _judge(names, got, want, tol, floors=None):
    """Each tensor against its reference; ``floors`` (one per tensor, ``_mlp_floors``): the normaliser's floor where
    the reference's sums cancel (``parity.cancellation_floor``)."""
    floors = floors or [0.0] * len(names)
    return [compare(n, g, w, tol, f) for n, g, w, f in zip(names, got, want, floors)]


def _mlp_floors(x, weights, adapters, dy, activation="silu", bias=None):
    """The normaliser's floor of each MLP tensor (MLP_NAMES' order) where its sums cancel, as
    ``parity.cancellation_floor`` reads it: Σ|terms| / √(terms), the tensor's last two sums expanded over the float64
    reference's own intermediates (|dg|, |du|, |act| at their values). Why: at N = 1, r = 1 every element of dA_gate
    is s·x_j times one 1536-term dot product dh = dg·B_g; where it cancels, max|ref| is far below its rounding error
    (≈ u·√(Σ (dg_i B_i)²) ≥ u·Σ|dg_i B_i| / √1536), and the plain max|ref| bound judged exact arithmetic's cancellation
    as the implementation's error (on an H100 with GeGLU; on the CPU with SwiGLU, 3 of 12 seeds at fp16 activations).
    Without cancellation Σ|t|/√(terms) ≈ 0.8·σ√(terms), below max|ref| ≈ 3·σ√(terms): the normalisation is unchanged."""
    s, r = SCALE, adapters[0].shape[0]
    xd = x.detach().double().reshape(-1, x.shape[-1])
    n, inter = xd.shape[0], weights[0].shape[0]
    w_g, w_u, w_d = (w.double() for w in weights)
    a_g, b_g, a_u, b_u, a_d, b_d = (t.detach().double() for t in adapters)
    dyd = dy.double().reshape(n, -1)
    bias_g, bias_u, _ = _mlp_bias_parts(bias, inter)
    g = xd @ w_g.t() + s * (xd @ a_g.t()) @ b_g.t() + bias_g
    u = xd @ w_u.t() + s * (xd @ a_u.t()) @ b_u.t() + bias_u
    f, df = fe.activation_parts(g, activation)
    act = f * u
    dact = s * (dyd @ b_d) @ a_d + dyd @ w_d
    dg, du, act = (dact * u * df).abs(), (dact * f).abs(), act.abs()
    ax, ady = xd.abs(), dyd.abs()
    parts = (
        (act @ w_d.abs().t() + s * (act @ a_d.abs().t()) @ b_d.abs().t(), inter * r),  # y
        (
            s * (dg @ b_g.abs()) @ a_g.abs() + s * (du @ b_u.abs()) @ a_u.abs() + dg @ w_g.abs() + du @ w_u.abs(),
            2 * inter * (r + 1),
        ),  # dx
        (s * (dg @ b_g.abs()).t() @ ax, inter * n),  # dA_gate
        (s * dg.t() @ (ax @ a_g.abs().t()), n * xd.shape[1]),  # dB_gate
        (s * (du @ b_u.abs()).t() @ ax, inter * n),  # dA_up
        (s * du.t() @ (ax @ a_u.abs().t()), n * xd.shape[1]),  # dB_up
        (s * (ady @ b_d.abs()).t() @ act, dyd.shape[1] * n),  # dA_down
        (s * ady.t() @ (act @ a_d.abs().t()), n * inter),  # dB_down
    )
    return [float(t.max()) / math.sqrt(terms) for t, terms in parts]


MLP_NAMES = ("y", "dx", "dA_gate", "dB_gate", "dA_up", "dB_up", "dA_down", "dB_down")
QKV_NAMES = ("q", "k", "v", "dx", "dA_q", "dB_q", "dA_k", "dB_k", "dA_v", "dB_v")


def _grid_cell(config, layout, seed):
    """One cell of a parity grid: its activation and adapter dtypes, a generator seeded with ``seed``, and its
    ranks (1, 16 and 64 for 2-D x, 16 for the other layouts)."""
    dtype, adapter_dtype = DTYPE_CONFIGS[config]
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return dtype, adapter_dtype, gen, (1, 16, 64) if layout == "2d" else (16,)


def _grid_check(what, config, layout, cases, run_report, check):
    rule = f"tol = {FUSED_STAGES}·8·(u_dtype + u_fp32·√k); lora_suite/tiers/quick/test_fused_parity.py"
    report_grid(run_report, check, cases, (what, config, layout), rule)


@pytest.mark.parametrize("layout", ["2d", "3d", "noncontig"])
@pytest.mark.parametrize("config", list(DTYPE_CONFIGS))
def test_fused_mlp_matches_float64(config, layout, run_report, check):
    _mlp_grid(config, layout, 2027, "silu", run_report, check)


@pytest.mark.parametrize("config", list(DTYPE_CONFIGS))
def test_fused_geglu_mlp_matches_float64(config, run_report, check):
    """Gemma's MLP (the gate through the tanh GELU) on the same grid, 2-D x: the GeGLU kernels' variants."""
    _mlp_grid(config, "2d", 2029, "gelu_tanh", run_report, check)


GATE_GRIDS = {"silu": ("MLP", "swiglu_forward", "SwiGLU"), "gelu_tanh": ("GeGLU MLP", "geglu_forward", "GeGLU")}


def _mlp_grid(config, layout, seed, activation, run_report, check):
    """The fused MLP with ``activation``'s gate over the grid against float64 (cancellation floors: ``_mlp_floors``),
    and the variants its gate kernel reached against the ones the grid's widths must take."""
    what, kernel, gate = GATE_GRIDS[activation]
    dtype, adapter_dtype, gen, ranks = _grid_cell(config, layout, seed)
    cases, before, name = [], kv.reached(), kv.DTYPE_NAME[dtype]
    for n, (k, inter), r in itertools.product(N_TOKENS, MLP_SHAPES, ranks):
        x, weights, adapters, dy = _mlp_case(n, k, inter, r, dtype, adapter_dtype, layout, gen)
        got_o, got_g = _mlp_fused(x, weights, adapters, dy, activation=activation)
        ref_o, ref_g = _mlp_reference(x, weights, adapters, dy, activation=activation)
        floors = _mlp_floors(x, weights, adapters, dy, activation)
        tol = FUSED_STAGES * tolerance(dtype, max(k, inter))
        cases.append((f"N={n} K={k} I={inter} r={r}", _judge(MLP_NAMES, got_o + got_g, ref_o + ref_g, tol, floors)))
    _grid_check(what, config, layout, cases, run_report, check)
    taken = sorted({v.variant for v in kv.reached_since(before) if v.kernel == kernel and v.dtype == name})
    check(
        f"fused {what} {config} {layout}: {gate} variants reached",
        " + ".join(taken),
        "==",
        " + ".join(sorted({_designed_swiglu(name, inter) for _, inter in MLP_SHAPES})),
        source="kernels/swiglu.cu: 16-byte vectors when I is a multiple of the vector width, else scalar",
    )


def _designed_swiglu(dtype: str, inter: int) -> str:
    """The SwiGLU variant the grid's I must take (the rule swiglu.cu is built for, restated here)."""
    width = kv.SWIGLU_VEC_WIDTH[dtype]
    return f"VEC={width if inter % width == 0 else 1}, {kv.residue(inter, width)}"


def _qkv_case(n, k, sizes, r, dtype, adapter_dtype, layout, gen):
    weights = [_randn((o, k), dtype, gen, 1 / math.sqrt(k)) for o in sizes]
    adapters = [t for o in sizes for t in _adapter_pair(o, k, r, adapter_dtype, gen)]
    x = _x(n, k, dtype, layout, gen)
    return x, weights, adapters, tuple(_randn((*x.shape[:-1], o), dtype, gen) for o in sizes)


def _qkv_reference(x, weights, adapters, dy, bias=None):
    d = [t.double() for t in weights]
    b = [0.0] * 3 if bias is None else bias.double().split([w.shape[0] for w in weights])

    def fn(x, a):
        return tuple(lora_linear_torch(x, d[i], a[2 * i], a[2 * i + 1], SCALE) + b[i] for i in range(3))

    return _run(fn, x.double(), [a.double() for a in adapters], tuple(t.double() for t in dy))


def _qkv_fused(x, weights, adapters, dy, bases=None, bias=None):
    bases = bases or QKVBases(tuple(w.shape[0] for w in weights), w_qkv=torch.cat(weights), bias=bias)
    return _run(lambda x, a: lora_qkv(x, bases, tuple(a), SCALE, backend="cupy"), x, adapters, dy)


@pytest.mark.parametrize("layout", ["2d", "3d", "noncontig"])
@pytest.mark.parametrize("config", list(DTYPE_CONFIGS))
def test_fused_qkv_matches_float64(config, layout, run_report, check):
    dtype, adapter_dtype, gen, ranks = _grid_cell(config, layout, 2028)
    cases = []
    for n, (k, sizes), r in itertools.product(N_TOKENS, QKV_SHAPES, ranks):
        x, weights, adapters, dy = _qkv_case(n, k, sizes, r, dtype, adapter_dtype, layout, gen)
        got_o, got_g = _qkv_fused(x, weights, adapters, dy)
        ref_o, ref_g = _qkv_reference(x, weights, adapters, dy)
        errs = _judge(QKV_NAMES, got_o + got_g, ref_o + ref_g, FUSED_STAGES * tolerance(dtype, k))
        cases.append((f"N={n} K={k} O={sizes} r={r}", errs))
    _grid_check("QKV", config, layout, cases, run_report, check)


@pytest.mark.parametrize("what", ["MLP", "QKV"])
@pytest.mark.parametrize("config", list(DTYPE_CONFIGS))
def test_fused_paths_with_biases_match_float64(what, config, run_report, check):
    """Frozen biases on every projection (Qwen2's q, k and v; an MLP's gate, up and down), each broadcast into its
    output before the GEMMs accumulate. The cases are the 2-D grid's own draws (its seed), the biases drawn apart
    (unit variance, as large as the outputs): the gradients are the grid's, what the biases change is judged."""
    mlp = what == "MLP"
    dtype, adapter_dtype, gen, ranks = _grid_cell(config, "2d", 2027 if mlp else 2028)
    bias_gen, cases = torch.Generator(device=DEV).manual_seed(2030), []
    names: tuple[str, ...]
    for n, (k, out), r in itertools.product(N_TOKENS, MLP_SHAPES if mlp else QKV_SHAPES, ranks):
        if mlp:
            assert isinstance(out, int)  # MLP_SHAPES: (K, intermediate width)
            x, weights, adapters, dy = _mlp_case(n, k, out, r, dtype, adapter_dtype, "2d", gen)
            bias = (_randn((2 * out,), dtype, bias_gen), _randn((k,), dtype, bias_gen))
            got = _mlp_fused(x, weights, adapters, dy, bias=bias)
            ref = _mlp_reference(x, weights, adapters, dy, bias=bias)
            names, floors, widest = MLP_NAMES, _mlp_floors(x, weights, adapters, dy, bias=bias), max(k, out)
        else:
            assert isinstance(out, tuple)  # QKV_SHAPES: (K, (O_q, O_k, O_v))
            x, weights, adapters, dy = _qkv_case(n, k, out, r, dtype, adapter_dtype, "2d", gen)
            bias = _randn((sum(out),), dtype, bias_gen)
            got = _qkv_fused(x, weights, adapters, dy, bias=bias)
            ref = _qkv_reference(x, weights, adapters, dy, bias=bias)
            names, floors, widest = QKV_NAMES, None, k
        errs = _judge(names, got[0] + got[1], ref[0] + ref[1], FUSED_STAGES * tolerance(dtype, widest), floors)
        cases.append((f"N={n} K={k} {'I' if mlp else 'O'}={out} r={r}", errs))
    _grid_check(f"{what} with biases", config, "2d", cases, run_report, check)


def test_fused_paths_on_nf4_bases_match_float64_of_the_dequantised_weights(run_report, check):
    """QLoRA: the fused paths dequantise their NF4 bases into one scratch buffer per pass; the reference uses the
    same dequantised values in float64, so the comparison judges the fused LoRA math, not NF4's rounding."""
    gen = torch.Generator(device=DEV).manual_seed(2029)
    cases = []
    for n in (37, 2048):
        x, weights, adapters, dy = _mlp_case(n, 576, 1536, 16, BF16, F32, "3d", gen)
        gate, up, down = (quantize_nf4(w) for w in weights)
        deq = [dequantize_nf4(t, BF16) for t in (gate, up, down)]
        got_o, got_g = _mlp_fused(x, weights, adapters, dy, bases=MLPBases(nf4=(gate, up, down)))
        ref_o, ref_g = _mlp_reference(x, deq, adapters, dy)
        cases.append(
            (f"MLP N={n}", _judge(MLP_NAMES, got_o + got_g, ref_o + ref_g, FUSED_STAGES * tolerance(BF16, 1536)))
        )
        x, weights, adapters, dy = _qkv_case(n, 576, (576, 192, 192), 16, BF16, F32, "3d", gen)
        q, k, v = (quantize_nf4(w) for w in weights)
        deq = [dequantize_nf4(t, BF16) for t in (q, k, v)]
        got_o, got_g = _qkv_fused(x, weights, adapters, dy, bases=QKVBases((576, 192, 192), nf4=(q, k, v)))
        ref_o, ref_g = _qkv_reference(x, deq, adapters, dy)
        cases.append(
            (f"QKV N={n}", _judge(QKV_NAMES, got_o + got_g, ref_o + ref_g, FUSED_STAGES * tolerance(BF16, 576)))
        )
    _grid_check("NF4", "bf16-act+fp32-adapters", "3d", cases, run_report, check)


@pytest.mark.parametrize("what", ["mlp", "qkv"])
def test_captured_fused_step_replays_bitwise_equal_to_eager(what, check):
    """Forward and backward of the fused path captured in one CUDA graph: replay equals an eager run bitwise."""
    gen = torch.Generator(device=DEV).manual_seed(2030)
    if what == "mlp":
        x, weights, adapters, dy = _mlp_case(2048, 576, 1536, 16, BF16, F32, "2d", gen)
        mlp_bases = MLPBases(w_gu=torch.cat(weights[:2]), w_d=weights[2])
        fn = lambda x, a: (lora_mlp(x, mlp_bases, tuple(a), SCALE, SCALE, backend="cupy"),)  # noqa: E731
        dys = (dy,)
    else:
        x, weights, adapters, dys = _qkv_case(2048, 576, (576, 192, 192), 16, BF16, F32, "2d", gen)
        qkv_bases = QKVBases((576, 192, 192), w_qkv=torch.cat(weights))
        fn = lambda x, a: lora_qkv(x, qkv_bases, tuple(a), SCALE, backend="cupy")  # noqa: E731
    xs = x.detach().clone().requires_grad_(True)
    params = [a.detach().clone().requires_grad_(True) for a in adapters]

    def step():
        outs = fn(xs, params)
        return [o.detach() for o in outs] + list(torch.autograd.grad(outs, [xs, *params], dys))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    graph.replay()
    eager = step()
    torch.cuda.synchronize()
    differing = [i for i, (s, e) in enumerate(zip(static, eager)) if not torch.equal(s, e)]
    check(f"fused {what}: captured replay tensors that differ from eager (of {len(eager)})", len(differing), "==", 0)
