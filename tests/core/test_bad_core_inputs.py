"""The bad-input battery (issue 20), lora_core (issue 28's findings): a second ``inject_lora``, NF4 weights near the
float32 limit or dequantised into an integer dtype, and a corrupt PEFT folder read by lora_core's own loader, each
refused with a ValueError that says what is wrong instead of a wrong model or a library traceback."""

from __future__ import annotations

import re

import pytest
import torch

import lora_core
from lora_core.nf4 import dequantize_nf4, quantize_nf4
from lora_suite.engine.models import build_tiny_llama


def _second_inject(tmp_path):
    model = build_tiny_llama()
    lora_core.inject_lora(model, ("q_proj",), r=2, backend="torch")
    lora_core.inject_lora(model, ("v_proj",), r=2, backend="torch")


def _nf4_near_the_float32_limit(tmp_path):
    quantize_nf4(torch.full((4, 64), 3.0e38))


def _nf4_into_an_integer_dtype(tmp_path):
    dequantize_nf4(quantize_nf4(torch.randn(4, 64)), torch.int32)


def _peft_folder_of_lora_core(tmp_path, corrupt: str):
    model = build_tiny_llama()
    lora_core.inject_lora(model, ("q_proj",), r=2, backend="torch")
    folder = tmp_path / "a"
    lora_core.save_peft_adapter(model, folder)
    if corrupt == "weights":
        weights = folder / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        (folder / "adapter_config.json").write_text("[1]")
    lora_core.load_peft_adapter(model, folder)


CORE_CASES = {  # what -> (the call, given a folder of its own; what the message must hold)
    "a second inject_lora call": (_second_inject, "already has 2 LoRA layer(s) (model.layers.0.self_attn.q_proj"),
    "NF4 weights near the float32 limit": (_nf4_near_the_float32_limit, "has values up to 3e+38: the double"),
    "NF4 dequantised into int32": (_nf4_into_an_integer_dtype, "dtype torch.int32 is not one of"),
    # library tracebacks that named no file
    "lora_core reads truncated weights": (
        lambda tmp_path: _peft_folder_of_lora_core(tmp_path, "weights"),
        "is not a readable safetensors",
    ),
    "lora_core reads a config list": (
        lambda tmp_path: _peft_folder_of_lora_core(tmp_path, "config"),
        "holds a JSON list, expected a PEFT",
    ),
}


@pytest.mark.parametrize("what", CORE_CASES)
def test_lora_core_inputs(what, tmp_path):
    call, expected = CORE_CASES[what]
    with pytest.raises(ValueError, match=re.escape(expected)):
        call(tmp_path)
