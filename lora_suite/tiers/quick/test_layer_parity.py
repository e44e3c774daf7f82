"""GPU parity of the cupy LoRA backend: y, dx, dA, dB against float64, plus stream, checkpoint, determinism.

Tolerances: ``lora_suite.engine.parity.tolerance`` (C·unit roundoff of the compute dtype, derivation in its
docstring). Each grid test records one row per case (its max errors and tolerance) in the run report.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.utils.checkpoint

import lora_core
from lora_suite.engine.parity import compare, parity, random_case, reference_f64, run_candidate, tolerance
from lora_suite.harness.report import Series

# lora_core's cupy op itself, below the model level: not applicable to an implementation that does not use it
pytestmark = [pytest.mark.gpu, pytest.mark.quick, pytest.mark.needs_feature("lora_core_ops")]

DEV = "cuda"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPE_CONFIGS = {  # name: (activation dtype, adapter dtype)
    "fp32": (F32, F32),
    "fp16": (F16, F16),
    "bf16": (BF16, BF16),
    "fp16-act+fp32-adapters": (F16, F32),
    "bf16-act+fp32-adapters": (BF16, F32),
}
N_TOKENS = (1, 37, 4096)
FEATURES = (1000, 333, 4096)
RANKS = (1, 8, 64)
SCALE = 2.0  # alpha 16 / r 8


def _n_shape(n: int, layout: str) -> tuple[int, ...]:
    if layout == "3d":
        return (2, n // 2) if n % 2 == 0 else (1, n)
    return (n,)


@pytest.mark.parametrize("layout", ["2d", "3d", "noncontig"])
@pytest.mark.parametrize("config", list(DTYPE_CONFIGS))
def test_cupy_matches_float64_over_shape_grid(config, layout, run_report, check):
    dtype, adapter_dtype = DTYPE_CONFIGS[config]
    gen = torch.Generator(device=DEV).manual_seed(1234)
    ranks = RANKS if layout == "2d" else (8,)  # the full rank sweep in 2-D; layouts at r = 8
    rows, failures = [], []
    for n, k, o, r in itertools.product(N_TOKENS, FEATURES, FEATURES, ranks):
        x, w, a, b, dy = random_case(
            _n_shape(n, layout), k, o, r, dtype, adapter_dtype, DEV, layout=layout, generator=gen
        )
        errs = parity(x, w, a, b, SCALE, dy, backend="cupy")
        ok = all(e.ok for e in errs)
        rows.append(
            (
                n,
                k,
                o,
                r,
                *(e.scaled_err for e in errs),
                max(e.max_abs_err for e in errs),
                errs[0].tol,
                "ok" if ok else "FAIL",
            )
        )
        failures += [f"N={n} K={k} O={o} r={r}: {e.describe()}" for e in errs if not e.ok]
    run_report.add_series(
        Series(
            test=f"parity {config} {layout}",
            name=f"cupy vs float64, {config}, x {layout}",
            columns=("N", "in", "out", "r", "y err", "dx err", "dA err", "dB err", "max abs err", "tol", "verdict"),
            rows=tuple(rows),
        )
    )
    check(
        f"{config} {layout}: tensors beyond tolerance (of {4 * len(rows)})",
        len(failures),
        "==",
        0,
        source="tol = 8·(u_dtype + u_fp32·√k); lora_suite/engine/parity.py",
        detail="; ".join(failures[:5]),
    )


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_rank_256_and_one(dtype, check):
    for r in (256, 1):
        x, w, a, b, dy = random_case((37,), 1000, 333, r, dtype, dtype, DEV)
        for e in parity(x, w, a, b, SCALE, dy):
            check(f"r={r} {e.name} max err / max ref", e.scaled_err, "<=", e.tol, detail=e.describe())


def test_x_without_grad_gives_adapter_grads_only(check):
    x, w, a, b, dy = random_case((3, 37), 1000, 333, 8, BF16, F32, DEV)
    x.requires_grad_(False)
    errs = parity(x, w, a, b, SCALE, dy)
    assert [e.name for e in errs] == ["y", "dA", "dB"]
    for e in errs:
        check(f"{e.name} max err / max ref", e.scaled_err, "<=", e.tol, detail=e.describe())


def test_scale_zero_is_base_layer_and_zero_adapter_grads(check):
    x, w, a, b, dy = random_case((37,), 1000, 333, 8, BF16, BF16, DEV)
    y, dx, da, db = run_candidate(x, w, a, b, 0.0, dy, "cupy")
    ref = torch.nn.functional.linear(x.detach().double(), w.double())
    e = compare("y", y, ref, tolerance(BF16, 1000))
    check("y vs base layer, max err / max ref", e.scaled_err, "<=", e.tol, detail=e.describe())
    check("max |dA| at scale 0", float(da.abs().max()), "==", 0.0)
    check("max |dB| at scale 0", float(db.abs().max()), "==", 0.0)


def test_same_input_twice_is_bit_identical():
    x, w, a, b, dy = random_case((4, 512), 768, 768, 16, BF16, F32, DEV)
    first = run_candidate(x, w, a, b, SCALE, dy, "cupy")
    second = run_candidate(x, w, a, b, SCALE, dy, "cupy")
    for name, u, v in zip(("y", "dx", "dA", "dB"), first, second):
        assert torch.equal(u, v), f"{name} differs between two identical runs (max diff {(u - v).abs().max()})"


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing_gives_identical_gradients(use_reentrant):
    layer = lora_core.LoRALinear.from_linear(
        torch.nn.Linear(768, 1024, bias=True, device=DEV, dtype=BF16), r=16, alpha=32, backend="cupy"
    )
    torch.nn.init.normal_(layer.lora_B, std=0.1)
    x0 = torch.randn(4, 256, 768, device=DEV, dtype=BF16)
    dy = torch.randn(4, 256, 1024, device=DEV, dtype=BF16)

    def grads(checkpointed: bool):
        layer.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=use_reentrant) if checkpointed else layer(x)
        y.backward(dy)
        return x.grad, layer.lora_A.grad.clone(), layer.lora_B.grad.clone()

    plain, ckpt = grads(False), grads(True)
    for name, u, v in zip(("dx", "dA", "dB"), plain, ckpt):
        assert torch.equal(u, v), (
            f"{name} differs under checkpoint(use_reentrant={use_reentrant}): {(u - v).abs().max()}"
        )


def test_non_default_stream_waits_for_producer_and_matches():
    """x is produced by a slow matmul on a side stream; the LoRA op on that stream must see it finished."""
    x_ref, w, a, b, dy = random_case((4096,), 4096, 4096, 16, BF16, BF16, DEV)
    expected = run_candidate(x_ref, w, a, b, SCALE, dy, "cupy")
    side = torch.cuda.Stream()
    big = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    eye = torch.eye(8192, device=DEV, dtype=BF16)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        slow = big @ eye  # keeps the side stream busy before x exists
        x = (x_ref.detach() + slow[:4096, :4096] * 0).requires_grad_()
        got = run_candidate(x, w, a, b, SCALE, dy, "cupy")
    torch.cuda.synchronize()
    for name, u, v in zip(("y", "dx", "dA", "dB"), expected, got):
        assert torch.equal(u, v), f"{name} on a side stream differs from the default stream: {(u - v).abs().max()}"


def test_two_backward_calls_accumulate():
    layer = lora_core.LoRALinear.from_linear(torch.nn.Linear(333, 1000, device=DEV, dtype=BF16), r=8, backend="cupy")
    torch.nn.init.normal_(layer.lora_B, std=0.1)
    x = torch.randn(37, 333, device=DEV, dtype=BF16, requires_grad=True)
    layer(x).float().square().sum().backward()
    once = layer.lora_A.grad.clone(), layer.lora_B.grad.clone(), x.grad.clone()
    layer(x).float().square().sum().backward()
    for name, g1, g2 in zip(("dA", "dB", "dx"), once, (layer.lora_A.grad, layer.lora_B.grad, x.grad)):
        assert torch.equal(g2, 2 * g1), (
            f"{name}: second backward did not accumulate (max diff {(g2 - 2 * g1).abs().max()})"
        )


def test_autocast_runs_in_autocast_dtype(check):
    x, w, a, b, dy = random_case((2, 37), 1000, 333, 8, F32, F32, DEV)
    with torch.autocast("cuda", dtype=BF16):
        y = lora_core.lora_linear(x, w, a.requires_grad_(), b.requires_grad_(), SCALE, backend="cupy")
    assert y.dtype == BF16, f"under autocast(bf16) the output is {y.dtype}, expected bfloat16 like F.linear"
    y.backward(dy.to(BF16))
    assert a.grad.dtype == F32 and b.grad.dtype == F32 and x.grad.dtype == F32
    # reference: float64 on the inputs autocast actually used (rounded to bf16)
    ref = reference_f64(x.detach().to(BF16).requires_grad_(), w.to(BF16), a, b, SCALE, dy.to(BF16))
    for name, got, r in zip(("y", "dx", "dA", "dB"), (y, x.grad, a.grad, b.grad), ref):
        e = compare(name, got, r, tolerance(BF16, 1000))
        check(f"autocast {name} max err / max ref", e.scaled_err, "<=", e.tol, detail=e.describe())


def test_nan_and_inf_propagate_like_torch():
    x, w, a, b, dy = random_case((37,), 333, 1000, 8, BF16, BF16, DEV)
    x = x.detach().clone()
    x[3, 5], x[7, 0] = float("nan"), float("inf")
    y_cupy = lora_core.lora_linear(x, w, a, b, SCALE, backend="cupy")
    y_torch = lora_core.lora_linear(x, w, a, b, SCALE, backend="torch")
    assert torch.equal(torch.isnan(y_cupy), torch.isnan(y_torch)), "NaN pattern differs from torch"
    assert torch.equal(torch.isinf(y_cupy), torch.isinf(y_torch)), "Inf pattern differs from torch"
    assert torch.isfinite(y_cupy[0]).all(), "a finite row was contaminated"


def test_backend_in_use_is_visible_and_memory_is_torchs():
    layer = lora_core.LoRALinear.from_linear(torch.nn.Linear(1000, 333, bias=False, device=DEV, dtype=BF16), r=8)
    before = lora_core.backend_call_counts()["cupy"]
    x = torch.randn(37, 1000, device=DEV, dtype=BF16, requires_grad=True)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    y = layer(x)
    assert layer.last_backend == "cupy", "the default backend for CUDA tensors with CuPy installed is cupy"
    assert lora_core.backend_call_counts()["cupy"] == before + 1
    assert "CupyLoRALinear" in type(y.grad_fn).__name__, f"grad_fn is {type(y.grad_fn).__name__}"
    assert torch.cuda.memory_allocated() - allocated >= y.numel() * y.element_size(), "output not counted by torch"
    import cupy

    assert cupy.get_default_memory_pool().used_bytes() == 0, "CuPy's own pool was used: torch stats would lie"


def test_cpu_tensors_with_cupy_backend_raise():
    x, w, a, b, _ = random_case((3,), 16, 8, 2, F32, F32, "cpu")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        lora_core.lora_linear(x, w, a, b, 1.0, backend="cupy")
    with pytest.raises(ValueError, match="one device"):
        lora_core.lora_linear(x.cuda(), w, a.cuda(), b.cuda(), 1.0, backend="cupy")


def test_parity_with_peft_lora_linear(check):
    peft = pytest.importorskip("peft", reason="peft is not installed: PEFT parity not checked")
    base = torch.nn.Sequential(torch.nn.Linear(1000, 333, bias=True)).to(DEV, BF16)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["0"], lora_dropout=0.0)
    model = peft.get_peft_model(base, config)  # PEFT's default: fp32 adapters on a bf16 base
    peft_layer = model.base_model.model[0]
    pa, pb = peft_layer.lora_A["default"].weight, peft_layer.lora_B["default"].weight
    with torch.no_grad():
        pb.normal_(std=0.3)
    ours = lora_core.LoRALinear(peft_layer.base_layer.weight, peft_layer.base_layer.bias, r=8, alpha=16, backend="cupy")
    with torch.no_grad():
        ours.lora_A.copy_(pa)
        ours.lora_B.copy_(pb)
    x = torch.randn(2, 37, 1000, device=DEV, dtype=BF16)
    dy = torch.randn(2, 37, 333, device=DEV, dtype=BF16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_peft, y_ours = peft_layer(x1), ours(x2)
    y_peft.backward(dy)
    y_ours.backward(dy)
    tol = 2 * tolerance(BF16, 1000)  # both sides carry bf16 rounding (PEFT runs the adapter path in fp32)
    for name, got, ref in (
        ("y", y_ours, y_peft),
        ("dx", x2.grad, x1.grad),
        ("dA", ours.lora_A.grad, pa.grad),
        ("dB", ours.lora_B.grad, pb.grad),
    ):
        e = compare(name, got, ref.double(), tol)
        check(
            f"PEFT parity {name} max err / max ref",
            e.scaled_err,
            "<=",
            tol,
            source="2x bf16 tolerance",
            detail=e.describe(),
        )
