"""GPU checks of the NF4 RawKernels against the torch reference, and LoRA over an NF4 base vs float64."""

from __future__ import annotations

import pytest
import torch

from lora_core.nf4 import (
    BLOCKSIZE,
    dequantize_nf4,
    dequantize_nf4_reference,
    quantize_nf4,
    quantize_nf4_reference,
    roundtrip_error_bound,
)
from lora_suite.judges.parity import compare, random_case, reference_f64, run_candidate, tolerance

# lora_core's NF4 kernels itself, below the model level: not applicable to an implementation that does not use them
pytestmark = [pytest.mark.gpu, pytest.mark.quick, pytest.mark.needs_feature("lora_core_ops")]

DEV = "cuda"


def _adversarial(dtype) -> torch.Tensor:
    w = torch.randn(64, 256, device=DEV) * 0.02
    w[0, :64] = 0.0  # an all-zero block
    w[1, 64:128] = 0.0
    w[1, 70] = 1e4  # one huge value: everything else in the block collapses to code 7
    w[2, :64] = 0.5  # a constant block: all at +1 -> code 15
    w[2, 64:128] = -3.0
    code = torch.tensor([-1.0, -0.6961928009986877, 0.0, 0.07958029955625534, 1.0], device=DEV)
    mids = (code[:-1] + code[1:]) / 2
    w[3, :4] = mids  # exact midpoints (ties go to the lower code) and the codes themselves
    w[3, 4:9] = code
    w[3, 9] = 1.0  # sets the block's absmax to 1 so the values above are the normalised ones
    return w.to(dtype)


WEIGHTS = {
    "random-bf16-4096x4096": lambda: (torch.randn(4096, 4096, device=DEV) * 0.02).bfloat16(),
    "random-fp16-1000x64": lambda: (torch.randn(1000, 64, device=DEV)).half(),
    "random-fp32-333x192": lambda: torch.randn(333, 192, device=DEV) * 3,
    "adversarial-fp32": lambda: _adversarial(torch.float32),
    "adversarial-bf16": lambda: _adversarial(torch.bfloat16),
}


def _differing(got: torch.Tensor | None, ref: torch.Tensor | None) -> int:
    """How many elements of two quantisation-state tensors differ; both are set (the same double_quant made both)."""
    assert got is not None and ref is not None, f"a quantisation state tensor is None: {got=} {ref=}"
    return int((got != ref).sum())


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "no-dq"])
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_kernels_bit_identical_to_reference(name, double_quant, check):
    w = WEIGHTS[name]()
    got, ref = quantize_nf4(w, double_quant=double_quant), quantize_nf4_reference(w, double_quant=double_quant)
    mismatched = int((got.packed != ref.packed).sum())
    check(f"{name}: packed bytes differing from the reference", mismatched, "==", 0)
    if double_quant:
        check(f"{name}: absmax int8 codes differing", _differing(got.absmax_q, ref.absmax_q), "==", 0)
        check(f"{name}: absmax scales differing", _differing(got.absmax_scale, ref.absmax_scale), "==", 0)
        check(f"{name}: absmax mean equal", got.absmax_mean == ref.absmax_mean, "==", True)
    else:
        check(f"{name}: absmax differing", _differing(got.absmax, ref.absmax), "==", 0)
    for dtype in (torch.float32, torch.bfloat16):
        d_kernel, d_ref = dequantize_nf4(got, dtype), dequantize_nf4_reference(ref, dtype)
        check(f"{name}: dequantised {dtype} elements differing", int((d_kernel != d_ref).sum()), "==", 0)
    err = (dequantize_nf4(got, torch.float32).float() - w.float()).abs().reshape(-1, BLOCKSIZE)
    excess = float((err - roundtrip_error_bound(got)[:, None]).max())
    check(
        f"{name}: round-trip error beyond NF4's bound",
        max(excess, 0.0),
        "==",
        0.0,
        source="|w - ŵ| <= absmax·0.3038/2 + double-quant error (lora_core/nf4.py)",
    )


def test_non_finite_weight_rejected():
    w = torch.randn(64, 64, device=DEV)
    w[3, 3] = float("inf")
    with pytest.raises(ValueError, match="1 non-finite value"):
        quantize_nf4(w)


@pytest.mark.parametrize("adapters", [torch.bfloat16, torch.float32], ids=["bf16-adapters", "fp32-adapters"])
def test_lora_over_nf4_base_matches_float64(adapters, check):
    x, w, a, b, dy = random_case((2, 37), 1024, 320, 8, torch.bfloat16, adapters, DEV)
    q = quantize_nf4(w)
    w_hat = dequantize_nf4(q, torch.bfloat16)  # the weight the op actually multiplies by
    got = run_candidate(x, q, a, b, 2.0, dy, "cupy")
    ref = reference_f64(x, w_hat, a, b, 2.0, dy)
    for name, g, r in zip(("y", "dx", "dA", "dB"), got, ref):
        e = compare(name, g, r, tolerance(torch.bfloat16, 1024))
        check(f"NF4 base, {name} max err / max ref", e.scaled_err, "<=", e.tol, detail=e.describe())


def test_nf4_base_keeps_no_16bit_weight_between_passes():
    """Memory held for backward = activations only: no (out, in) 16-bit weight survives the forward."""
    x, w, a, b, dy = random_case((8, 512), 4096, 4096, 16, torch.bfloat16, torch.float32, DEV)
    q = quantize_nf4(w)
    del w
    import lora_core

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = lora_core.lora_linear(x, q, a.requires_grad_(), b.requires_grad_(), 2.0, backend="cupy")
    held = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    weight_bytes = 4096 * 4096 * 2
    assert held < weight_bytes / 4, f"{held} bytes held after forward: a 16-bit weight copy ({weight_bytes}) survived"
    y.backward(dy)
