"""Adapter checkpoints: safetensors round trip and the errors for a checkpoint that does not fit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lora_core.checkpoint import ADAPTER_FILE, STATE_FILE, load_adapter_checkpoint, save_adapter_checkpoint
from lora_core.inject import adapter_parameters, inject_lora
from lora_core.models import build_random
from tests.conftest import TINY_ARCH


def _model(targets=("q_proj", "v_proj"), r=4):
    m = build_random(TINY_ARCH, torch.float32, "cpu")
    inject_lora(m, targets, r=r)
    return m


def test_round_trip(tmp_path):
    a = _model()
    with torch.no_grad():
        for p in adapter_parameters(a).values():
            p.normal_()
    save_adapter_checkpoint(a, tmp_path, step=3, extra={"note": "x"})
    saved = load_file(str(tmp_path / ADAPTER_FILE))
    assert set(saved) == set(adapter_parameters(a)) and json.loads((tmp_path / STATE_FILE).read_text())["step"] == 3
    assert not list(tmp_path.glob(".*tmp*")), "temporary files left behind"
    b = _model()
    assert load_adapter_checkpoint(b, tmp_path) == 3
    assert all(torch.equal(p, adapter_parameters(a)[n]) for n, p in adapter_parameters(b).items())


def test_mismatches_are_named(tmp_path):
    save_adapter_checkpoint(_model(), tmp_path, step=1)
    with pytest.raises(ValueError, match=r"does not fit the model: missing \['model.layers.0.self_attn.k_proj.lora_A'"):
        load_adapter_checkpoint(_model(("q_proj", "k_proj", "v_proj")), tmp_path)
    with pytest.raises(ValueError, match=r"lora_A has shape \(4, 64\), the model's is \(2, 64\)"):
        load_adapter_checkpoint(_model(r=2), tmp_path)
    with pytest.raises(FileNotFoundError, match="resuming needs optimizer state"):
        m = _model()
        load_adapter_checkpoint(m, tmp_path, optimizer=torch.optim.AdamW(adapter_parameters(m).values()))
    with pytest.raises(FileNotFoundError, match="no adapter checkpoint"):
        load_adapter_checkpoint(_model(), tmp_path / "missing")
