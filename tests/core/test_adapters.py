"""PEFT-format adapters on the CPU: our folder loads in PEFT, PEFT's loads in ours, merging keeps the logits."""

from __future__ import annotations

import json

import pytest
import torch

import lora_core
from lora_core.inject import adapter_parameters, inject_lora
from lora_suite.engine.models import build_random
from tests.conftest import TINY_ARCH

peft = pytest.importorskip("peft", reason="PEFT is the reference format: install lora-gpu-suite[peft]")
IDS = torch.randint(0, TINY_ARCH.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))


def _base():
    return build_random(TINY_ARCH, torch.float32, "cpu", seed=0)


def _ours(targets=("q_proj", "v_proj"), r=4, alpha=8, quantize=None, use_rslora=False):
    m = _base()
    inject_lora(m, targets, r=r, alpha=alpha, backend="torch", quantize=quantize, use_rslora=use_rslora)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter_parameters(m).values():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return m


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_our_folder_loads_in_peft_with_equal_logits(tmp_path):
    ours = _ours()
    lora_core.save_peft_adapter(ours, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["target_modules"]) == (
        "LORA",
        4,
        8,
        ["q_proj", "v_proj"],
    )
    theirs = peft.PeftModel.from_pretrained(_base(), str(tmp_path / "a"))
    torch.testing.assert_close(_logits(theirs), _logits(ours), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("alpha", "use_rslora"), [(5.0, False), (16, True), (3.0, True)], ids=["alpha5", "rslora16", "rslora3"]
)
def test_an_rslora_or_odd_alpha_folder_loads_in_peft_with_equal_logits(alpha, use_rslora, tmp_path):
    """Issue 28's blind spot: a scale that is not the plain alpha/r relation survives the round trip into PEFT (a
    folder written with a wrong lora_alpha or without use_rslora fails this, as the plants below show)."""
    ours = _ours(("q_proj", "v_proj", "gate_proj"), r=4, alpha=alpha, use_rslora=use_rslora)
    lora_core.save_peft_adapter(ours, tmp_path / "a")
    theirs = peft.PeftModel.from_pretrained(_base(), str(tmp_path / "a"))
    torch.testing.assert_close(_logits(theirs), _logits(ours), rtol=1e-5, atol=1e-5)
    config_path = tmp_path / "a" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    for planted in ({"lora_alpha": config["lora_alpha"] * 2}, {"use_rslora": not config["use_rslora"]}):
        config_path.write_text(json.dumps({**config, **planted}))
        wrong = peft.PeftModel.from_pretrained(_base(), str(tmp_path / "a"))
        assert not torch.allclose(_logits(wrong), _logits(ours), rtol=1e-5, atol=1e-5), f"planted {planted} passed"


def test_a_peft_folder_loads_into_our_layers_with_equal_logits(tmp_path):
    theirs = peft.get_peft_model(
        _base(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    theirs.save_pretrained(str(tmp_path / "p"))
    ours = _ours()
    loaded = lora_core.load_peft_adapter(ours, tmp_path / "p")
    assert len(loaded) == 2 * TINY_ARCH.num_hidden_layers
    torch.testing.assert_close(_logits(ours), _logits(theirs), rtol=1e-5, atol=1e-5)


def test_keys_that_fit_no_layer_are_refused_by_name(tmp_path):
    ours = _ours()
    lora_core.save_peft_adapter(ours, tmp_path / "a")
    with pytest.raises(
        ValueError,
        match=r"keys that fit no layer \[\].*layers without weights \['base_model.model.model.layers.0.self_attn.k_proj",
    ):
        lora_core.load_peft_adapter(_ours(("q_proj", "k_proj", "v_proj")), tmp_path / "a")
    with pytest.raises(ValueError, match=r"has r=4, alpha=8.* but r=2, alpha=8"):
        lora_core.load_peft_adapter(_ours(r=2), tmp_path / "a")


def test_merged_logits_equal_unmerged_and_layers_are_plain_linear():
    ours = _ours(("all-linear",))
    before = _logits(ours)
    lora_core.merge_lora(ours)
    assert not lora_core.inject.lora_modules(ours)
    assert all(type(m) is torch.nn.Linear for n, m in ours.named_modules() if n.endswith(("q_proj", "down_proj")))
    torch.testing.assert_close(_logits(ours), before, rtol=1e-5, atol=1e-5)


def test_merging_an_nf4_base_returns_16_bit_or_requantises():
    ours = _ours(quantize="nf4")
    before = _logits(ours)
    merged16 = lora_core.merge_lora(_copy(ours))
    torch.testing.assert_close(_logits(merged16), before, rtol=1e-4, atol=1e-4)  # exact but for fp32 rounding
    merged_nf4 = lora_core.merge_lora(_copy(ours), nf4="nf4")
    q = merged_nf4.model.layers[0].self_attn.q_proj
    assert isinstance(q, lora_core.NF4Linear)
    # re-quantised = NF4 of the merged 16-bit weight, bit for bit (its own rounding is NF4's, not the merge's)
    w16 = merged16.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(
        lora_core.dequantize_nf4(q.nf4, w16.dtype), lora_core.dequantize_nf4(lora_core.quantize_nf4(w16), w16.dtype)
    )


def _copy(model):
    import copy

    return copy.deepcopy(model)
