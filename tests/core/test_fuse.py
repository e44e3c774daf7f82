"""fuse_lora / inject_lora(fuse=...): a whole tiny Llama through the fused MLP and QKV paths equals the unfused
model (logits and every adapter's gradient, float64), keeps its parameter names and PEFT files, reports the
fused path per layer, and refuses by name what it cannot fuse."""

from __future__ import annotations

import pytest
import torch

from lora_core import FuseError, fuse_lora, inject_lora, load_peft_adapter, save_peft_adapter
from lora_core.fuse import LoRAMLP
from lora_core.inject import adapter_parameters, lora_modules
from lora_suite.engine.models import build_random
from tests.conftest import TINY_ARCH


def _pair(targets="all-linear", fuse=("mlp", "qkv", "o"), dtype=torch.float64, quantize=None):
    plain = build_random(TINY_ARCH, dtype, "cpu", seed=3)
    fused = build_random(TINY_ARCH, dtype, "cpu", seed=3)
    inject_lora(plain, targets, r=4, alpha=8, backend="torch", adapter_dtype=None, quantize=quantize)
    inject_lora(fused, targets, r=4, alpha=8, backend="torch", adapter_dtype=None, quantize=quantize, fuse=fuse)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for (n, p), (m, q) in zip(adapter_parameters(plain).items(), adapter_parameters(fused).items()):
            assert n == m
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
            q.copy_(p)
    return plain, fused


def _loss_and_grads(model, ids):
    out = model(input_ids=ids, labels=ids)
    params = adapter_parameters(model)
    grads = torch.autograd.grad(out.loss, list(params.values()))
    return out.logits.detach(), dict(zip(params, grads))


def _assert_same_function(plain, fused, ids, logits_tol, grad_rtol, grad_atol):
    """``fused`` gives ``plain``'s logits (rtol = atol = ``logits_tol``) and every adapter's gradient on ``ids``."""
    logits_p, grads_p = _loss_and_grads(plain, ids)
    logits_f, grads_f = _loss_and_grads(fused, ids)
    torch.testing.assert_close(logits_f, logits_p, rtol=logits_tol, atol=logits_tol)
    assert grads_f.keys() == grads_p.keys()
    for name in grads_p:
        torch.testing.assert_close(grads_f[name], grads_p[name], rtol=grad_rtol, atol=grad_atol, msg=name)


def test_the_fused_model_equals_the_unfused_one_in_float64():
    plain, fused = _pair()
    ids = torch.randint(0, TINY_ARCH.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    _assert_same_function(plain, fused, ids, 1e-10, 1e-9, 1e-12)
    paths = {n.rsplit(".", 1)[-1]: m.last_backend for n, m in lora_modules(fused).items()}
    assert paths == {
        "q_proj": "torch-fused-qkv",
        "k_proj": "torch-fused-qkv",
        "v_proj": "torch-fused-qkv",
        "o_proj": "torch",
        "gate_proj": "torch-fused-mlp",
        "up_proj": "torch-fused-mlp",
        "down_proj": "torch-fused-mlp",
    }
    assert isinstance(fused.model.layers[0].mlp, LoRAMLP)
    assert fused.state_dict().keys() == plain.state_dict().keys()


def test_fusion_under_gradient_checkpointing_and_after_a_dtype_move():
    plain, fused = _pair(dtype=torch.float32)
    plain, fused = plain.double(), fused.double()  # the shared gate/up and q/k/v buffers are rebuilt after .to()
    for m in (plain, fused):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
    ids = torch.randint(0, TINY_ARCH.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    _assert_same_function(plain, fused, ids, 1e-10, 1e-9, 1e-12)
    gate, up = fused.model.layers[0].mlp.gate_proj, fused.model.layers[0].mlp.up_proj
    assert up.weight.data_ptr() == gate.weight.data_ptr() + gate.weight.numel() * gate.weight.element_size()


def test_the_fused_model_on_nf4_bases_equals_the_unfused_nf4_model():
    plain, fused = _pair(dtype=torch.float32, quantize="nf4")
    ids = torch.randint(0, TINY_ARCH.vocab_size, (1, 8), generator=torch.Generator().manual_seed(3))
    _assert_same_function(plain, fused, ids, 1e-4, 1e-3, 1e-5)


def test_a_fused_model_writes_and_reads_the_same_peft_folder(tmp_path):
    plain, fused = _pair()
    save_peft_adapter(fused, tmp_path / "a")
    fresh = build_random(TINY_ARCH, torch.float64, "cpu", seed=3)
    inject_lora(fresh, "all-linear", r=4, alpha=8, backend="torch", adapter_dtype=None)
    load_peft_adapter(fresh, tmp_path / "a")
    for (n, p), q in zip(adapter_parameters(plain).items(), adapter_parameters(fresh).values()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize(
    ("targets", "fuse", "message"),
    [
        (
            ("q_proj", "v_proj"),
            ("mlp",),
            r"fuse='mlp' at model.layers.0.mlp: \['gate_proj', 'up_proj', 'down_proj'\] are not",
        ),
        (("q_proj", "v_proj"), ("qkv",), r"fuse='qkv' at model.layers.0.self_attn: \['k_proj'\] are not LoRA layers"),
        ("all-linear", ("swiglu",), r"fuse=\['swiglu'\]: expected one or more of \('mlp', 'qkv', 'o'\)"),
    ],
)
def test_what_cannot_be_fused_is_refused_by_name(targets, fuse, message):
    model = build_random(TINY_ARCH, torch.float32, "cpu")
    with pytest.raises(FuseError, match=message):
        inject_lora(model, targets, r=4, backend="torch", fuse=fuse)


def test_a_geglu_mlp_fuses_and_equals_the_unfused_one_in_float64():
    """Gemma's MLP: the gate through the tanh GELU (transformers' gelu_pytorch_tanh), probed, not named."""
    from lora_core.fuse import LoRAMLP

    plain, fused = _pair(fuse=())
    for model in (plain, fused):
        for layer in model.model.layers:
            layer.mlp.act_fn = torch.nn.GELU(approximate="tanh")
    fuse_lora(fused, ("mlp", "qkv", "o"))
    assert {m.activation for m in fused.modules() if isinstance(m, LoRAMLP)} == {"gelu_tanh"}
    ids = torch.randint(0, TINY_ARCH.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    _assert_same_function(plain, fused, ids, 1e-10, 1e-8, 1e-10)


def test_a_non_gated_activation_is_refused_by_name():
    model = build_random(TINY_ARCH, torch.float32, "cpu")
    inject_lora(model, "all-linear", r=4, backend="torch")
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()  # the exact (erf) GELU: neither gate the kernels compute
    with pytest.raises(FuseError, match="the activation is GELU, but the fused MLP takes a SiLU gate"):
        fuse_lora(model, "mlp")


def _add_biases(model, names, seed):
    for i, layer in enumerate(model.model.layers):
        for block, name in names:
            proj = getattr(getattr(layer, block), name)
            b = torch.randn(proj.out_features, generator=torch.Generator().manual_seed(seed + 10 * i + len(name)))
            proj.bias = torch.nn.Parameter(b.double(), requires_grad=False)


@pytest.mark.parametrize(
    "biased,group",
    [
        # an MLP's up and down: gate's part of the stacked [b_g; b_u] is zero
        ((("mlp", "up_proj"), ("mlp", "down_proj")), "mlp"),
        # Qwen2's attention, here q and v: k's part of the stacked bias is zero
        ((("self_attn", "q_proj"), ("self_attn", "v_proj")), "qkv"),
    ],
)
def test_biases_fuse_and_equal_the_unfused_model_in_float64(biased, group):
    """Frozen biases on a group's projections, each broadcast into its output before the fused GEMMs accumulate."""
    plain, fused = _pair(fuse=())
    for model in (plain, fused):
        _add_biases(model, biased, 20 if group == "mlp" else 0)
    fuse_lora(fused, ("mlp", "qkv", "o"))
    ids = torch.randint(0, TINY_ARCH.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    _assert_same_function(plain, fused, ids, 1e-10, 1e-9, 1e-12)
    block = biased[0][0]
    served = {m.last_backend for n, m in lora_modules(fused).items() if f".{block}." in n and "o_proj" not in n}
    assert served == {f"torch-fused-{group}"}


@pytest.mark.parametrize("block,name", [("mlp", "down_proj"), ("mlp", "gate_proj"), ("self_attn", "k_proj")])
def test_a_bias_that_requires_grad_is_refused_not_dropped(block, name):
    """The fused paths take biases as constants: a trainable one would lose its gradient, so it is refused by name."""
    plain, fused = _pair(fuse=("mlp", "qkv", "o"))
    proj = getattr(getattr(fused.model.layers[0], block), name)
    proj.bias = torch.nn.Parameter(torch.zeros(proj.out_features, dtype=torch.float64), requires_grad=True)
    ids = torch.randint(0, TINY_ARCH.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    with pytest.raises(FuseError, match="has a bias that requires grad"):
        fused(input_ids=ids)
