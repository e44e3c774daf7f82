"""lora_core.bnb_format on the CPU, against a state recorded from bitsandbytes 0.50.2 (tests/fixtures/bnb_nf4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lora_core.bnb_format import QS_KEY, BnbFormatError, from_bnb, from_bnb_state_dict, nf4_weights, to_bnb_state_dict
from lora_core.nf4 import dequantize_nf4, quantize_nf4_reference, roundtrip_error_bound

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "bnb_nf4" / "bnb_nf4_100x512.safetensors"


@pytest.fixture(scope="module")
def recorded():
    return load_file(str(FIXTURE))


def _state(recorded, variant):
    return {k.removeprefix(f"{variant}."): v for k, v in recorded.items() if k.startswith(f"{variant}.w")}


@pytest.mark.parametrize("variant", ["nested", "plain"])
def test_dequantisation_is_bitwise_bitsandbytes_own(recorded, variant):
    q = from_bnb_state_dict(_state(recorded, variant), prefix="w")
    assert q.shape == (100, 512) and q.dtype == torch.bfloat16 and (q.absmax_code is not None) == (variant == "nested")
    assert torch.equal(dequantize_nf4(q), recorded[f"{variant}.dequant_bf16"])
    assert torch.equal(dequantize_nf4(q, torch.float32), recorded[f"{variant}.dequant_fp32"])


def test_lora_core_writes_the_same_codes_and_reads_none_of_the_state_again(recorded):
    ours = quantize_nf4_reference(recorded["source_weight"])
    q = from_bnb_state_dict(_state(recorded, "nested"), prefix="w")
    assert torch.equal(ours.packed, q.packed)  # byte-identical packed codes, as issue 19 measured on the GPU
    assert q.absmax_q.dtype == torch.uint8 and q.absmax_scale.numel() == 4  # 800 absmaxes: 3 full nested blocks + 1


@pytest.mark.parametrize("variant", ["nested", "plain"])
def test_a_bitsandbytes_state_goes_back_byte_for_byte(recorded, variant):
    state = _state(recorded, variant)
    back = to_bnb_state_dict(from_bnb_state_dict(state, prefix="w"), prefix="w")
    assert sorted(back) == sorted(state)
    for key, value in state.items():
        if key.endswith(QS_KEY):
            assert json.loads(bytes(back[key].tolist())) == json.loads(bytes(value.tolist()))
        else:
            assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


def test_lora_core_own_quantisation_goes_out_with_exact_fp32_absmaxes(recorded):
    ours = quantize_nf4_reference(recorded["source_weight"])  # lora_core's linear int8 double quantisation
    state = to_bnb_state_dict(ours, prefix="layer.weight")
    assert "layer.weight.nested_absmax" not in state and state["layer.weight.absmax"].dtype == torch.float32
    again = from_bnb_state_dict(state, prefix="layer.weight")
    assert torch.equal(dequantize_nf4(again), dequantize_nf4(ours))


def test_a_live_quant_state_object_is_read_by_attribute(recorded):
    state = _state(recorded, "nested")
    meta = json.loads(bytes(state[f"w.{QS_KEY}"].tolist()))

    class State2:
        absmax, code, blocksize, dtype = state["w.nested_absmax"], state["w.nested_quant_map"], 256, torch.float32

    class QuantState:  # the attributes of bitsandbytes.functional.QuantState that from_bnb reads
        quant_type, absmax, code, blocksize = "nf4", state["w.absmax"], state["w.quant_map"], 64
        dtype, shape, nested, state2 = torch.bfloat16, torch.Size(meta["shape"]), True, State2()
        offset = torch.tensor(meta["nested_offset"], dtype=torch.float32)

    q = from_bnb(state["w"], QuantState())
    assert torch.equal(dequantize_nf4(q), recorded["nested.dequant_bf16"])
    with pytest.raises(BnbFormatError, match="quant_state of type int is neither a bitsandbytes QuantState"):
        from_bnb(state["w"], 3)


def _broken(recorded, **change):
    state = dict(_state(recorded, "nested"))
    meta = json.loads(bytes(state[f"w.{QS_KEY}"].tolist()))
    for key, value in change.items():
        if key in meta:
            meta[key] = value
        else:
            state[f"w.{key}"] = value
    state[f"w.{QS_KEY}"] = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)
    return state


@pytest.mark.parametrize(
    "change, message",
    [
        ({"quant_type": "fp4"}, "quant_type 'fp4': only 'nf4' is supported"),
        ({"blocksize": 128}, "blocksize 128: lora_core's NF4 kernels use 64"),
        ({"nested_blocksize": 512}, "nested blocksize 512: expected 256"),
        ({"dtype": "int8"}, "dtype 'int8' is not one of"),
        ({"shape": [100, 256]}, r"25600 bytes: expected uint8 with 12800 bytes for shape \(100, 256\)"),
        ({"shape": [51200]}, r"shape \(51200,\): expected a 2-D weight"),
        ({"quant_map": torch.linspace(-1, 1, 16)}, "not the NF4 code"),
        ({"absmax": torch.zeros(799, dtype=torch.uint8)}, "absmax has 799 values, expected 800"),
        ({"absmax": torch.zeros(800)}, "nested absmax codes of dtype torch.float32: expected uint8"),
        ({"nested_quant_map": torch.zeros(16)}, r"quant map of 16 values \(expected 256\)"),
    ],
)
def test_a_state_lora_core_cannot_hold_is_refused_naming_the_value(recorded, change, message):
    with pytest.raises(BnbFormatError, match=message):
        from_bnb_state_dict(_broken(recorded, **change), prefix="w")


def test_missing_and_foreign_entries_are_named(recorded):
    state = _state(recorded, "nested")
    with pytest.raises(BnbFormatError, match="no packed weight 'x.weight' in the state dict"):
        from_bnb_state_dict(state, prefix="x.weight")
    partial = {k: v for k, v in state.items() if not k.endswith("quant_map")}
    with pytest.raises(BnbFormatError, match=r"lacks \['quant_map'\]"):
        from_bnb_state_dict(partial, prefix="w")
    fp4 = {k.replace("__nf4", "__fp4"): v for k, v in state.items()}
    with pytest.raises(BnbFormatError, match="only 'quant_state.bitsandbytes__nf4' \\(NF4\\) is supported"):
        from_bnb_state_dict(fp4, prefix="w")
    garbled = dict(state, **{f"w.{QS_KEY}": torch.tensor([255, 0], dtype=torch.uint8)})
    with pytest.raises(BnbFormatError, match="not the JSON bytes bitsandbytes writes"):
        from_bnb_state_dict(garbled, prefix="w")


def test_the_error_bound_is_not_claimed_for_bitsandbytes_double_quantisation(recorded):
    q = from_bnb_state_dict(_state(recorded, "nested"), prefix="w")
    with pytest.raises(ValueError, match="bitsandbytes' double quantisation"):
        roundtrip_error_bound(q)


def test_a_lora_layer_runs_on_the_checkpoints_own_codes(recorded):
    """What a QLoRA user holding a bitsandbytes checkpoint gets: lora_core layers built on its NF4 codes, whose
    base output is bitsandbytes' dequantised weight applied to x (B starts at 0)."""
    from lora_core.layer import LoRALinear

    def under(path, variant):  # the fixture's prefix "w" as transformers names it: "<module path>.weight"
        return {f"{path}.weight{k[1:]}": v for k, v in _state(recorded, variant).items()}

    prefixed = under("model.layers.0.self_attn.q_proj", "nested") | under("model.layers.0.mlp.up_proj", "plain")
    prefixed["model.embed_tokens.weight"] = torch.zeros(4, 4)
    weights = nf4_weights(prefixed)
    assert sorted(weights) == ["model.layers.0.mlp.up_proj", "model.layers.0.self_attn.q_proj"]
    layer = LoRALinear(weights["model.layers.0.self_attn.q_proj"], r=4, alpha=8, backend="torch", quantize="nf4")
    assert (layer.out_features, layer.in_features) == (100, 512) and "weight_absmax_code" in layer.state_dict()
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    expected = x @ recorded["nested.dequant_bf16"].t()
    assert torch.equal(layer(x), expected)
    with pytest.raises(ValueError, match="weight is an NF4Tensor but quantize=None: pass quantize='nf4'"):
        LoRALinear(weights["model.layers.0.mlp.up_proj"], r=4, alpha=8)
    with pytest.raises(BnbFormatError, match="no bitsandbytes NF4 weight in the state dict"):
        nf4_weights({"model.embed_tokens.weight": torch.zeros(4, 4)})


def test_a_model_quantised_by_bitsandbytes_converts_to_lora_core_layers_on_its_own_codes():
    """transformers' BitsAndBytesConfig(load_in_4bit, nf4, double quant) puts bitsandbytes Linear4bit layers in
    the model; inject_lora(quantize="nf4") turns them into lora_core's LoRALinear / NF4Linear on the same codes
    and state (bitsandbytes 0.50 quantises on the CPU, so this runs without a GPU)."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: pip install lora-gpu-suite[peft-bnb]")
    import bitsandbytes.functional as F
    from torch import nn

    from lora_core.inject import inject_lora, replace_module
    from lora_core.layer import LoRALinear, NF4Linear
    from lora_suite.implementations.peft_bnb_impl import bnb_nf4_linear

    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("q_proj", nn.Linear(128, 64, bias=False, dtype=torch.bfloat16))
    model.add_module("up_proj", nn.Linear(64, 128, bias=True, dtype=torch.bfloat16))
    expected = {}
    for name, linear in list(model.named_children()):
        q = bnb_nf4_linear(linear)  # peft-bnb's: as transformers' 4-bit loading quantises (bf16 compute, on the CPU)
        expected[name] = F.dequantize_4bit(q.weight.data, q.weight.quant_state)
        replace_module(model, name, q)
    with pytest.raises(ValueError, match="holds a bitsandbytes 4-bit weight, but quantize=None: pass quantize='nf4'"):
        LoRALinear.from_linear(model.q_proj, r=4, alpha=8)
    inject_lora(model, ("q_proj",), r=4, alpha=8, backend="torch", quantize="nf4")
    assert isinstance(model.q_proj, LoRALinear) and isinstance(model.up_proj, NF4Linear)
    for name in ("q_proj", "up_proj"):
        nf4 = getattr(model, name).nf4
        assert nf4.absmax_code is not None  # bitsandbytes' own nested state, not quantised again
        assert torch.equal(dequantize_nf4(nf4), expected[name])
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    assert torch.equal(model.q_proj(x), x @ expected["q_proj"].t())  # B = 0 at start
