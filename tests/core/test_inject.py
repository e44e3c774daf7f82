"""inject_lora: which linears get adapters, what is frozen, and the errors."""

from __future__ import annotations

import pytest
import torch

from lora_core import LoRALinear
from lora_core.inject import adapter_parameters, inject_lora, lora_modules
from lora_core.layer import NF4Linear
from lora_suite.engine.models import build_random
from tests.conftest import TINY_ARCH


@pytest.fixture
def model():
    return build_random(TINY_ARCH, torch.float32, "cpu")


def test_q_v_targets(model):
    names = inject_lora(model, ("q_proj", "v_proj"), r=4)
    assert names == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    ]
    assert isinstance(model.model.layers[1].self_attn.v_proj, LoRALinear)


def test_all_linear_skips_the_lm_head_and_freezes_the_rest(model):
    names = inject_lora(model, "all-linear", r=4)
    assert len(names) == 7 * TINY_ARCH.num_hidden_layers and not any("lm_head" in n for n in names)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(adapter_parameters(model)) and len(trainable) == 2 * len(names)


def test_target_matching_nothing_is_an_error():
    lone = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"LoRA target\(s\) \['q_proj'\] match no nn.Linear.*named \['0'\]"):
        inject_lora(lone, ("q_proj",))


def test_unknown_target_name_is_an_error(model):
    with pytest.raises(ValueError, match=r"targets \['qkv'\] are not among"):
        inject_lora(model, ("qkv",))


def test_nf4_quantises_the_other_linears_but_not_the_lm_head(model):
    inject_lora(model, ("q_proj",), r=2, quantize="nf4")
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, LoRALinear) and layer.self_attn.q_proj.weight is None
    assert isinstance(layer.mlp.down_proj, NF4Linear) and isinstance(model.lm_head, torch.nn.Linear)
    assert len(lora_modules(model)) == 2
    out = model(input_ids=torch.randint(0, 300, (1, 8)), labels=torch.randint(0, 300, (1, 8)))
    out.loss.backward()
    assert all(p.grad is not None for p in adapter_parameters(model).values())
