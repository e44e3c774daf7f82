"""LoRALinear semantics on the CPU (torch reference backend)."""

from __future__ import annotations

import math

import pytest
import torch

from lora_core import LoRALinear, lora_scale


def _layer(bias=True, **kw):
    torch.manual_seed(0)
    return LoRALinear.from_linear(torch.nn.Linear(16, 8, bias=bias), **kw)


def test_b_zero_gives_exactly_the_base_output():
    base = torch.nn.Linear(16, 8)
    layer = LoRALinear.from_linear(base, r=4, alpha=8)
    x = torch.randn(5, 16)
    assert torch.equal(layer(x), base(x))


def test_scale_and_rslora():
    assert lora_scale(8, 16) == 2.0
    assert lora_scale(16, 16, use_rslora=True) == 4.0
    assert _layer(r=4, alpha=8).scale == 2.0
    assert _layer(r=4, alpha=8, use_rslora=True).scale == 4.0
    with pytest.raises(ValueError, match="r=0 must be a positive integer"):
        lora_scale(0, 16)


def test_forward_is_the_lora_formula_with_bias():
    layer = _layer(r=4, alpha=8)
    torch.nn.init.normal_(layer.lora_B)
    x = torch.randn(3, 16)
    expected = x @ layer.weight.T + layer.bias + 2.0 * (x @ layer.lora_A.T) @ layer.lora_B.T
    torch.testing.assert_close(layer(x), expected)


def test_base_is_frozen_and_shared_and_gets_no_gradient():
    base = torch.nn.Linear(16, 8)
    layer = LoRALinear.from_linear(base, r=2)
    assert layer.weight.data_ptr() == base.weight.data_ptr(), "the base weight must be shared, not copied"
    assert not layer.weight.requires_grad and not layer.bias.requires_grad
    torch.nn.init.normal_(layer.lora_B)
    layer(torch.randn(4, 16)).square().sum().backward()
    assert layer.weight.grad is None and layer.bias.grad is None
    assert layer.lora_A.grad is not None and layer.lora_A.grad.abs().sum() > 0
    assert layer.lora_B.grad is not None and layer.lora_B.grad.abs().sum() > 0


def test_parameter_names_and_trainable_set():
    layer = _layer(r=2)
    assert dict(layer.named_parameters()).keys() == {"weight", "bias", "lora_A", "lora_B"}
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["lora_A", "lora_B"]
    assert layer.lora_A.shape == (2, 16) and layer.lora_B.shape == (8, 2)


def test_init_like_peft():
    layer = _layer(r=4)
    assert torch.count_nonzero(layer.lora_B) == 0
    bound = 1 / math.sqrt(16)  # kaiming_uniform(a=√5) on fan_in 16, as nn.Linear
    assert layer.lora_A.abs().max() <= bound and layer.lora_A.std() > bound / 4


def test_adapter_dtype_defaults_to_fp32_and_can_follow_base():
    base = torch.nn.Linear(16, 8, dtype=torch.bfloat16)
    assert LoRALinear.from_linear(base).lora_A.dtype == torch.float32
    assert LoRALinear.from_linear(base, adapter_dtype=None).lora_A.dtype == torch.bfloat16
    assert LoRALinear.from_linear(torch.nn.Linear(4, 4, dtype=torch.float64)).lora_A.dtype == torch.float64


def test_backend_is_visible_on_the_module():
    layer = _layer(backend="torch")
    assert layer.last_backend is None
    layer(torch.randn(2, 16))
    assert layer.last_backend == "torch" and "backend=torch" in repr(layer)


def test_bad_construction_raises():
    with pytest.raises(ValueError, match="from_linear expects an nn.Linear, got Conv1d"):
        LoRALinear.from_linear(torch.nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match="backend='gpu' is not known"):
        LoRALinear.from_linear(torch.nn.Linear(2, 2), backend="gpu")
    with pytest.raises(ValueError, match=r"weight must be a 2-D tensor.*\(3,\)"):
        LoRALinear(torch.randn(3))
