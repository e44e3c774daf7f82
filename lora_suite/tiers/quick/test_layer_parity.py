"""What only lora_core's cupy op has: scale 0 is the base layer, activation checkpointing of the op, the backend
it reports and the memory it takes from torch, its refusal of CPU tensors, and its parity with PEFT's layer.

The float64 parity grid, determinism, accumulation, a side stream, NaN rows and autocast are judged for every
implementation through its own layers (``tiers/quick/test_layer_probes.py``), lora_core's included.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint

import lora_core
from lora_suite.judges.parity import compare, random_case, run_candidate, tolerance

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


def test_scale_zero_is_base_layer_and_zero_adapter_grads(check):
    x, w, a, b, dy = random_case((37,), 1000, 333, 8, BF16, BF16, DEV)
    y, dx, da, db = run_candidate(x, w, a, b, 0.0, dy, "cupy")
    ref = torch.nn.functional.linear(x.detach().double(), w.double())
    e = compare("y", y, ref, tolerance(BF16, 1000))
    check("y vs base layer, max err / max ref", e.scaled_err, "<=", e.tol, detail=e.describe())
    check("max |dA| at scale 0", float(da.abs().max()), "==", 0.0)
    check("max |dB| at scale 0", float(db.abs().max()), "==", 0.0)


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


@pytest.mark.model_code
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
        assert ref is not None, f"PEFT's {name} is None after backward (x1 and its adapters require grad)"
        e = compare(name, got, ref.double(), tol)
        check(
            f"PEFT parity {name} max err / max ref",
            e.scaled_err,
            "<=",
            tol,
            source="2x bf16 tolerance",
            detail=e.describe(),
        )
