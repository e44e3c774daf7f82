"""lora_core.ops.nf4_matmul on the CPU: which absmax form a tensor's state is read as, and bad operands named
before any launch (the kernel itself is checked on the GPU: tiers/quick/test_nf4_matmul_kernel.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lora_core.nf4 import quantize_nf4
from lora_core.ops import nf4_matmul as NM


@pytest.fixture
def q():
    return quantize_nf4(torch.randn(128, 192) * 0.02, double_quant=True)


def test_each_state_is_read_in_its_own_form(q):
    plain = quantize_nf4(torch.randn(64, 64), double_quant=False)
    bnb = dataclasses.replace(q, absmax_code=torch.linspace(-1, 1, 256))
    assert [NM.absmax_form(t) for t in (plain, q, bnb)] == ["fp32", "int8", "dcode"]
    assert set(NM.FORMS) == {"fp32", "int8", "dcode"}


def test_the_wrapper_imports_the_triton_source_only_when_it_launches():
    import subprocess
    import sys

    code = "import sys, lora_core.ops.nf4_matmul; print('lora_core.ops.nf4_matmul_kernel' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda q: (torch.randn(4, 192), q, None), "x has dtype torch.float32"),
        (lambda q: (torch.randn(4, 64, dtype=torch.bfloat16), q, None), r"expected \(M, 192\)"),
        (lambda q: (torch.randn(192, 4, dtype=torch.bfloat16).T, q, None), "unit column stride"),
        (lambda q: (torch.randn(4, 192, dtype=torch.bfloat16), "weights", None), "must be an NF4Tensor, got str"),
        (lambda q: (torch.randn(4, 192, dtype=torch.bfloat16), q, None), "both must be on one CUDA device"),
        (
            lambda q: (torch.randn(4, 192, dtype=torch.bfloat16), quantize_nf4(torch.randn(64, 32)), None),
            "K a multiple of 64",
        ),
    ],
)
def test_bad_operands_are_named_before_a_launch(q, make, message):
    x, w, out = make(q)
    with pytest.raises(ValueError, match=message):
        NM.check_operands(x, w, out)


def test_a_bad_out_is_named(q):
    x = torch.randn(4, 192, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out has shape \(4, 127\)"):
        NM.check_operands(x, q, torch.empty(4, 127, dtype=torch.bfloat16))
