"""lora_core.experts: LoRA on 3-D expert parameters, against PEFT's ``target_parameters`` (the reference) on a tiny
Qwen3-MoE, in float64 on the torch backend (the cupy backend runs the same per-expert lora_linear, on the GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lora_core.adapters import load_peft_adapter, merge_lora, save_peft_adapter
from lora_core.experts import LoRAExperts, expert_form_error, expert_modules
from lora_core.inject import adapter_parameters, inject_lora
from lora_suite.engine.architectures import ARCHITECTURES
from lora_suite.implementations import peft_names

peft = pytest.importorskip("peft")
MOE = ARCHITECTURES["qwen3_moe"]
PARAMS = ("gate_up_proj", "down_proj")


def _model(seed: int = 0) -> nn.Module:
    return MOE.build(torch.float64, "cpu", seed=seed)


def _ours(params=PARAMS, seed=0) -> nn.Module:
    m = _model()
    inject_lora(m, ("q_proj",), r=4, alpha=8, backend="torch", target_parameters=params, adapter_dtype=None)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(m).values():
            p.normal_(0, 0.3)
    return m


def _peft(params=PARAMS) -> nn.Module:
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=list(params))
    return peft.get_peft_model(_model(), cfg)


def _ids():
    return torch.randint(0, MOE.build(torch.float64, "cpu").config.vocab_size, (2, 7), generator=torch.manual_seed(3))


def _copy_into_peft(ours: nn.Module, theirs: nn.Module) -> None:
    """Our factors into PEFT's ParamWrappers, through PEFT's own layout (peft_names.expert_a / expert_b)."""
    theirs_sd = {n: p for n, p in theirs.named_parameters() if "lora_" in n}
    with torch.no_grad():
        for path, m in expert_modules(ours).items():
            names = list(m.adapters)
            for k, name in enumerate(names):
                wrapper = f"base_model.model.{path}" + ".base_layer" * (len(names) - 1 - k)
                a = theirs_sd[f"{wrapper}.lora_A.default.weight"]
                b = theirs_sd[f"{wrapper}.lora_B.default.weight"]
                peft_names.expert_a(a, experts=m.num_experts).copy_(m.adapters[name].lora_A)
                peft_names.expert_b(b, experts=m.num_experts).copy_(m.adapters[name].lora_B)
        for n, p in theirs_sd.items():
            if "experts" not in n:
                key = n.removeprefix("base_model.model.").replace(".default.weight", "")
                p.copy_(adapter_parameters(ours)[key])


@pytest.mark.parametrize("params", [PARAMS, ("gate_up_proj",), ("down_proj",)])
def test_function_is_peft_target_parameters(params):
    ours, theirs = _ours(params), _peft(params)
    _copy_into_peft(ours, theirs)
    ids = _ids()
    torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, rtol=1e-12, atol=1e-12)


def test_unrouted_expert_gets_exactly_zero_gradient_and_routed_nonzero():
    m = _ours()
    ids = _ids()[:1, :1]  # one token: k of E experts per MoE layer
    m(ids).logits.square().sum().backward()
    for path, ex in expert_modules(m).items():
        for name, f in ex.adapters.items():
            moved = [bool(f.lora_A.grad[e].abs().max() > 0) for e in range(ex.num_experts)]
            assert sum(moved) == 2, f"{path}.{name}: top-2 routing moved {moved}"  # num_experts_per_tok 2
            assert all(bool(f.lora_B.grad[e].abs().max() > 0) == moved[e] for e in range(ex.num_experts))


def test_save_loads_into_peft_and_peft_folder_loads_back(tmp_path):
    ours = _ours()
    save_peft_adapter(ours, tmp_path / "a")
    theirs = peft.PeftModel.from_pretrained(_model(), tmp_path / "a")
    ids = _ids()
    want = ours(ids).logits
    torch.testing.assert_close(theirs(ids).logits, want, rtol=1e-12, atol=1e-12)
    theirs.save_pretrained(tmp_path / "b")
    back = _ours(seed=9)
    assert load_peft_adapter(back, tmp_path / "b")
    for n, p in adapter_parameters(back).items():
        assert torch.equal(p, adapter_parameters(ours)[n]), n
    torch.testing.assert_close(back(ids).logits, want, rtol=0, atol=0)


def test_merge_folds_each_expert_and_gives_the_original_module_back():
    m = _ours()
    ids = _ids()
    want = m(ids).logits
    cls = type(m.model.layers[1].mlp.experts.original)
    merge_lora(m)
    assert type(m.model.layers[1].mlp.experts) is cls and not expert_modules(m)
    torch.testing.assert_close(m(ids).logits, want, rtol=1e-10, atol=1e-10)


def test_base_names_and_frozen_base_are_kept():
    before = set(dict(_model().named_parameters()))
    m = _ours()
    after = {n for n, _ in m.named_parameters() if ".adapters." not in n and "lora_" not in n}
    assert after == before
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable == set(adapter_parameters(m))


def test_other_forms_are_refused_naming_what_differs():
    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_experts, self.act_fn = 2, nn.SiLU()
            self.gate_up_proj = nn.Parameter(torch.zeros(2, 8, 12))  # (E, H, 2I): Llama 4's layout
            self.down_proj = nn.Parameter(torch.zeros(2, 6, 8))

    assert "transposed layout" in expert_form_error(Transposed())
    with pytest.raises(ValueError, match=r"cannot adapt.*Transposed"):
        LoRAExperts(Transposed(), PARAMS)
    with pytest.raises(ValueError, match=r"target_parameters \['up_proj'\] select no parameter"):
        inject_lora(_model(), ("q_proj",), target_parameters=("up_proj",))
    with pytest.raises(ValueError, match=r"parameters \['router'\] are not among"):
        LoRAExperts(_model().model.layers[1].mlp.experts, ("router",))
