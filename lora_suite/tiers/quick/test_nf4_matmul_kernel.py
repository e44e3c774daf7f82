"""GPU checks of lora_core's mixed-input NF4 GEMMs (``lora_core.ops.nf4_matmul``, Triton kernels), each form:
``nf4_matmul`` (the dequantised tile as the product's second operand) and ``weight_first_matmul`` (as its first).

Two properties, each over every absmax form an NF4Tensor can hold (fp32, lora_core's int8 double quantisation,
bitsandbytes' nested map):
- the weight it multiplies by is the RawKernel's dequantisation bit for bit: with x = I (K × K), y = I Ŵᵀ = Ŵᵀ
  exactly (one product of 1 · ŵ per output, accumulated in fp32, rounded back to the 16-bit ŵ);
- y matches float64 x Ŵᵀ within the bf16/fp16 GEMM bound, over a grid of shapes whose M and N are not multiples
  of the kernel's tiles (the masked edges), K from one NF4 block to 4096, written into a column slice of a wider
  output as a fused projection would.
"""

from __future__ import annotations

import pytest
import torch

from lora_core.nf4 import NF4Tensor, dequantize_nf4, quantize_nf4
from lora_suite.judges.parity import compare, tolerance

pytestmark = [pytest.mark.gpu, pytest.mark.quick, pytest.mark.needs_feature("lora_core_ops")]

DEV = "cuda"


def _bnb_form(q: NF4Tensor) -> NF4Tensor:
    """``q`` with its absmaxes held as bitsandbytes holds them: uint8 indices into a 256-entry map, a scale per
    256 blocks, a mean (any map will do: the kernel and the RawKernel must read the same one the same way)."""
    n_blocks = q.packed.numel() * 2 // q.blocksize
    gen = torch.Generator(device=DEV).manual_seed(3)
    idx = torch.randint(0, 256, (n_blocks,), device=DEV, generator=gen).to(torch.uint8)
    dcode = torch.linspace(-1.0, 1.0, 256, device=DEV)
    scale = torch.rand((n_blocks + 255) // 256, device=DEV, generator=gen) * 0.01
    return NF4Tensor(q.packed, q.shape, q.dtype, q.blocksize, None, idx, scale, 0.0173, absmax_code=dcode)


FORMS = {
    "fp32-absmax": lambda w: quantize_nf4(w, double_quant=False),
    "int8-double-quant": lambda w: quantize_nf4(w, double_quant=True),
    "bitsandbytes-nested": lambda w: _bnb_form(quantize_nf4(w, double_quant=True)),
}


KERNELS = ("nf4_matmul", "weight_first_matmul")


@pytest.fixture(scope="module", params=KERNELS)
def nf4_matmul(request):
    """(the form's name, the function)."""
    pytest.importorskip("triton", reason="lora_core.ops.nf4_matmul is a Triton kernel; triton is not installed")
    from lora_core.ops import nf4_matmul as NM

    return request.param, getattr(NM, request.param)


def identity_mismatches(matmul, form: str, dtype: torch.dtype) -> int:
    """Elements of ``matmul``(I, Ŵ) = Ŵᵀ differing from the RawKernel's Ŵᵀ (0 when it multiplies by the same Ŵ)."""
    w = torch.randn(200, 192, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1)) * 0.02
    w[3, :64] = 0.0  # an all-zero block
    q = FORMS[form](w.to(dtype))
    got = matmul(torch.eye(192, device=DEV, dtype=dtype), q)  # (K, N) = Ŵᵀ
    return int((got != dequantize_nf4(q, dtype).T).sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("form", list(FORMS))
def test_the_weight_it_multiplies_by_is_the_dequantisation_bit_for_bit(nf4_matmul, form, dtype, check):
    name, matmul = nf4_matmul
    n_diff = identity_mismatches(matmul, form, dtype)
    check(f"{name} {form} {dtype}: elements of I·Ŵᵀ differing from the RawKernel's Ŵᵀ", n_diff, "==", 0)


SHAPES = [(1, 64, 64), (37, 200, 192), (130, 300, 1024), (512, 4096, 4096)]  # (M, N, K)


def slice_errors(matmul, form: str, m: int, n: int, k: int):
    """(y's error against float64 x Ŵᵀ, whether the columns beside the output slice were left alone)."""
    gen = torch.Generator(device=DEV).manual_seed(m + n + k)
    q = FORMS[form]((torch.randn(n, k, device=DEV, generator=gen) * 0.02).bfloat16())
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    wide = torch.full((m, n + 96), float("nan"), device=DEV, dtype=torch.bfloat16)
    matmul(x, q, out=wide[:, 32 : 32 + n])
    ref = x.double() @ dequantize_nf4(q, torch.bfloat16).double().T
    untouched = bool(torch.isnan(wide[:, :32]).all() and torch.isnan(wide[:, 32 + n :]).all())
    return compare("y", wide[:, 32 : 32 + n], ref, tolerance(torch.bfloat16, k)), untouched


@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("form", list(FORMS))
def test_matches_float64_into_a_column_slice(nf4_matmul, form, m, n, k, check):
    name, matmul = nf4_matmul
    e, untouched = slice_errors(matmul, form, m, n, k)
    check(f"{name} {form} {m}x{n}x{k}: y max err / max ref", e.scaled_err, "<=", e.tol, detail=e.describe())
    check(f"{name} {form} {m}x{n}x{k}: columns outside the slice left as they were", untouched, "==", True)


def test_bad_operands_are_named(nf4_matmul):
    nf4_matmul = nf4_matmul[1]
    q = quantize_nf4((torch.randn(128, 128, device=DEV) * 0.02).bfloat16())
    with pytest.raises(ValueError, match=r"x has dtype torch.float32"):
        nf4_matmul(torch.randn(4, 128, device=DEV), q)
    with pytest.raises(ValueError, match=r"expected \(M, 128\)"):
        nf4_matmul(torch.randn(4, 64, device=DEV, dtype=torch.bfloat16), q)
    with pytest.raises(ValueError, match=r"out has shape \(4, 127\)"):
        nf4_matmul(torch.randn(4, 128, device=DEV, dtype=torch.bfloat16), q, out=torch.empty(4, 127, device=DEV))
