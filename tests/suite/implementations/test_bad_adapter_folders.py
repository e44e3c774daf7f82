"""The bad-input battery (issue 20), adapter folders (PEFT format): folders without a config or weights, with keys
that fit no adapter, tensors of the wrong shape, a corrupt weights file, or saved under another alpha, refused by
the implementations' readers (``lora_suite.implementations.load_peft_tensors`` and each ``load_adapter``) with the
file named and the model's adapters untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from lora_suite.implementations import ImplementationError, load_peft_tensors
from lora_suite.settings.implementation_names import known_names

PFX = "base_model.model.model.layers.0.self_attn.q_proj"
A, B = f"{PFX}.lora_A.weight", f"{PFX}.lora_B.weight"
CONFIG = '{"r": 4, "lora_alpha": 8}'


def _adapters():
    return {
        "model.layers.0.self_attn.q_proj.lora_A": nn.Parameter(torch.zeros(4, 16)),
        "model.layers.0.self_attn.q_proj.lora_B": nn.Parameter(torch.zeros(16, 4)),
    }


def _folder(tmp_path: Path, tensors: dict | None, config: str | None = CONFIG) -> Path:
    from safetensors.torch import save_file

    d = tmp_path / "adapter"
    d.mkdir()
    if config is not None:
        (d / "adapter_config.json").write_text(config)
    if tensors is not None:
        save_file(tensors, str(d / "adapter_model.safetensors"))
    return d


ADAPTER_CASES = {  # what -> (the folder's tensors, its adapter_config.json, what the message must hold)
    "no config": (
        {A: torch.zeros(4, 16), B: torch.zeros(16, 4)},
        None,
        "has no adapter_config.json: not a PEFT folder",
    ),
    "config not JSON": ({A: torch.zeros(4, 16)}, "{r: 4", "adapter_config.json is not valid JSON"),
    "a key that fits no adapter": (
        {A: torch.zeros(4, 16), B: torch.zeros(16, 4), "base_model.model.lm_head.lora_A.weight": torch.zeros(1)},
        CONFIG,
        "keys that fit no adapter ['base_model.model.lm_head.lora_A.weight']",
    ),
    "an adapter without a key": ({A: torch.zeros(4, 16)}, CONFIG, f"adapters without a key ['{B}']"),
    "a wrong shape": (
        {A: torch.zeros(8, 16), B: torch.zeros(16, 4)},
        CONFIG,
        f"{A} has shape (8, 16), the model's adapter (4, 16)",
    ),
    "a transposed B": (
        {A: torch.zeros(4, 16), B: torch.zeros(4, 16)},
        CONFIG,
        f"{B} has shape (4, 16), the model's adapter (16, 4)",
    ),
}


@pytest.mark.parametrize("what", ADAPTER_CASES)
def test_adapter_folder(what, tmp_path):
    tensors, config, expected = ADAPTER_CASES[what]
    folder = _folder(tmp_path, tensors, config)
    adapters = _adapters()
    before = {n: p.detach().clone() for n, p in adapters.items()}
    with pytest.raises((ImplementationError, ValueError)) as err:
        load_peft_tensors("peft", adapters, folder)
    assert expected in str(err.value), str(err.value)
    assert all(torch.equal(p, before[n]) for n, p in adapters.items()), "a refused folder changed adapters"


def test_adapter_folder_without_weights(tmp_path):
    folder = _folder(tmp_path, None)
    with pytest.raises(Exception, match="adapter_model.safetensors"):
        load_peft_tensors("peft", _adapters(), folder)


def test_adapter_folder_with_a_corrupt_weights_file(tmp_path):
    folder = _folder(tmp_path, None)
    (folder / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not a header")
    with pytest.raises(Exception, match="(?i)header|safetensor|deserializ"):
        load_peft_tensors("peft", _adapters(), folder)


@pytest.mark.parametrize("impl", known_names())
def test_an_adapter_folder_of_another_alpha(impl, tmp_path, tiny_prepared):
    """Issue 28: peft, loralib and torchtune resumed a folder saved with another alpha without a word (lora_core's own
    loader refused it): the same tensors under another scale are another model. Every implementation that runs here
    must refuse it."""
    try:
        prepared = tiny_prepared(impl)
    except ImplementationError as err:  # not installed, or not for a 16-bit base on the CPU: says why
        pytest.skip(str(err))
    prepared.implementation.save_adapter(prepared.model, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    config["lora_alpha"] = alpha = 2 * config["lora_alpha"]
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(
        (ImplementationError, ValueError),
        match=rf"has lora_alpha={alpha!r}, the model's adapters|"
        rf"has r=\d+, alpha={alpha!r}, rslora=\w+ in the folder but",
    ):
        prepared.implementation.load_adapter(prepared.model, tmp_path / "a")
