"""The fused stacks' MLP kernel follows the model's activation the way each stack's own patcher chooses it
(``lora_suite.implementations.fused_lora``): a SwiGLU kernel put over Gemma's GELU MLP computes another function
(issue 55's architecture matrix caught exactly that on an H100: Axolotl on gemma2, logits 0.55 off)."""

from __future__ import annotations

import types

import pytest
import torch

from lora_suite.engine.architectures import ARCHITECTURES
from lora_suite.implementations import ImplementationError
from lora_suite.implementations.axolotl_impl import axolotl_mlp_kernel
from lora_suite.implementations.fused_lora import activation_of, install_fused_lora
from lora_suite.implementations.unsloth_impl import unsloth_mlp_kernel


def _kernels(calls: list) -> types.SimpleNamespace:
    def mlp(name, takes_inplace=True):
        def apply(m, x, inplace=True):
            calls.append((name, inplace))
            return m.down_proj(m.act_fn(m.gate_proj(x)) * m.up_proj(x))

        def apply_no_inplace(m, x):
            calls.append((name, None))
            return m.down_proj(m.act_fn(m.gate_proj(x)) * m.up_proj(x))

        return apply if takes_inplace else apply_no_inplace

    return types.SimpleNamespace(
        apply_lora_mlp_swiglu=mlp("swiglu"),
        apply_lora_mlp_geglu=mlp("geglu"),
        apply_lora_mlp_geglu_exact=mlp("geglu_exact"),
        apply_lora_mlp_geglu_approx=mlp("geglu_approx", takes_inplace=False),
        apply_lora_qkv=lambda attn, x, **kw: (attn.q_proj.base(x), attn.k_proj.base(x), attn.v_proj.base(x)),
        apply_lora_o=lambda attn, x: attn.o_proj.base(x),
    )


def _model(family: str):
    model = ARCHITECTURES[family].build(torch.float32, "cpu")
    for name, module in model.named_modules():  # the kernels above call each projection's own forward as .base
        if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")):
            module.base = types.MethodType(type(module).forward, module)
    return model


@pytest.mark.parametrize(
    "family,chooser,expected",
    [
        ("gemma2", axolotl_mlp_kernel, ("geglu", True)),  # Axolotl: any "gelu" to its erf GeGLU
        ("llama", axolotl_mlp_kernel, ("swiglu", True)),
        ("gemma2", unsloth_mlp_kernel, ("geglu_approx", None)),  # Unsloth: the tanh form, which takes no inplace
        ("qwen2", unsloth_mlp_kernel, ("swiglu", False)),
    ],
)
def test_the_mlp_kernel_follows_the_models_activation(family, chooser, expected):
    calls: list = []
    model = _model(family)
    install_fused_lora(
        model, _kernels(calls), mlp_kernel=chooser, **({"inplace": False} if chooser is unsloth_mlp_kernel else {})
    )
    model(torch.tensor([[1, 2, 3]]))
    assert calls and set(calls) == {expected}, calls


def test_the_activation_is_read_where_the_patchers_read_it():
    assert activation_of(_model("gemma2")) == "gelu_pytorch_tanh"
    assert activation_of(_model("llama")) == "silu"
    assert activation_of(torch.nn.Linear(2, 2)) is None  # the probe block: SwiGLU


@pytest.mark.parametrize("chooser", [axolotl_mlp_kernel, unsloth_mlp_kernel])
def test_an_activation_no_kernel_computes_is_refused_by_name(chooser):
    with pytest.raises(ImplementationError, match="'relu2'"):
        chooser("relu2")
