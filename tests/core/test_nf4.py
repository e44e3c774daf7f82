"""NF4 on the CPU: the reference quantiser, packing order, double quantisation, bounds and errors."""

from __future__ import annotations

import pytest
import torch

from lora_core import LoRALinear
from lora_core.nf4 import (
    DQ_BLOCKSIZE,
    MAX_CODE_GAP,
    NF4_CODE,
    dequantize_nf4,
    quantize_nf4,
    quantize_nf4_reference,
    roundtrip_error_bound,
)

CODE = torch.tensor(NF4_CODE)


def test_codes_are_the_nearest_nf4_value():
    w = torch.randn(64, 128)
    q = quantize_nf4_reference(w, double_quant=False)
    codes = torch.stack([q.packed >> 4, q.packed & 0xF], dim=1).reshape(-1).long()
    x = (w.reshape(-1, 64) / q.absmax[:, None]).reshape(-1)
    nearest = (x[:, None] - CODE[None, :]).abs().argmin(dim=1)
    assert torch.equal(codes, nearest)  # random data has no exact ties


def test_packing_order_high_nibble_first():
    w = torch.zeros(1, 64)
    w[0, 0], w[0, 1], w[0, 2] = -1.0, 1.0, 0.0  # codes 0, 15, 7
    q = quantize_nf4_reference(w, double_quant=False)
    assert q.packed[0].item() == (0 << 4) | 15 and q.packed[1].item() == (7 << 4) | 7


def test_ties_go_to_the_lower_code_and_zero_blocks_are_zero():
    w = torch.zeros(2, 64)
    w[0, 0] = 1.0
    w[0, 1] = (NF4_CODE[7] + NF4_CODE[8]) / 2  # exactly between 0 and 0.0796 (in fp32)
    q = quantize_nf4_reference(w, double_quant=False)
    assert q.packed[0].item() & 0xF == 7 and q.absmax[1].item() == 0.0
    assert torch.equal(dequantize_nf4(q, torch.float32)[1], torch.zeros(64))


def test_double_quant_arithmetic():
    w = torch.randn(300, 256) * torch.linspace(0.01, 3.0, 300)[:, None]  # absmaxes spread widely
    q = quantize_nf4_reference(w)
    exact = quantize_nf4_reference(w, double_quant=False).absmax
    assert q.absmax_q.dtype == torch.int8 and q.absmax_scale.numel() == -(-exact.numel() // DQ_BLOCKSIZE)
    assert q.absmax_mean == pytest.approx(float(exact.mean()), rel=1e-6)
    per_block_scale = q.absmax_scale.repeat_interleave(DQ_BLOCKSIZE)[: exact.numel()]
    assert ((q.block_absmax() - exact).abs() <= per_block_scale / 254 * (1 + 1e-5)).all()
    assert q.nbytes() * 8 / w.numel() == pytest.approx(4 + 8 / 64 + 32 / (64 * 256), rel=0.01)


@pytest.mark.parametrize("double_quant", [True, False])
def test_round_trip_within_nf4_bound(double_quant):
    w = torch.randn(128, 192) * 0.05
    w[5, :64] = 0.0
    w[6, 70] = 40.0  # one huge value
    q = quantize_nf4(w, double_quant=double_quant)
    err = (dequantize_nf4(q, torch.float32) - w).abs().reshape(-1, 64)
    assert (err <= roundtrip_error_bound(q)[:, None]).all()
    assert MAX_CODE_GAP == pytest.approx(1.0 - 0.6961928009986877)  # between -1 and the next code


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: torch.randn(64), r"expects a 2-D weight .*got shape \(64,\)"),
        (lambda: torch.randn(3, 7), r"has 21 elements, not a multiple of the block size 64"),
        (lambda: torch.full((64, 64), float("nan")), r"has 4096 non-finite value\(s\)"),
        (lambda: torch.randn(64, 64).double(), r"dtype torch.float64, expected one of"),
    ],
)
def test_bad_weights_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        quantize_nf4(make())


def test_only_blocksize_64():
    with pytest.raises(ValueError, match="blocksize=128: only 64"):
        quantize_nf4(torch.randn(128, 128), blocksize=128)


def test_lora_over_nf4_on_cpu_uses_the_dequantised_weight():
    linear = torch.nn.Linear(128, 64, bias=False)
    layer = LoRALinear.from_linear(linear, r=4, quantize="nf4", backend="torch")
    torch.nn.init.normal_(layer.lora_B)
    x = torch.randn(5, 128)
    w_hat = dequantize_nf4(layer.nf4, torch.float32)
    expected = x @ w_hat.T + layer.scale * (x @ layer.lora_A.T) @ layer.lora_B.T
    torch.testing.assert_close(layer(x), expected)
    assert layer.weight is None and (w_hat - linear.weight).abs().max() > 0
