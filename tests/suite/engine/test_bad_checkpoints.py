"""The bad-input battery (issue 20), checkpoints: adapter checkpoints (adapters, optimizer state, manifest) that are
missing, partial, corrupt or hold NaN, refused by ``lora_suite.engine.checkpoint`` with the folder named and the
model's adapters untouched; and a model's ``local_path`` that holds no checkpoint (``lora_suite.engine.models``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch

from lora_suite.engine.checkpoint import MANIFEST_FILE, load_adapter_checkpoint, save_adapter_checkpoint
from lora_suite.engine.models import build_model
from lora_suite.engine.optimizer import make_optimizer
from lora_suite.settings.config import CONFIG_DIR
from lora_suite.settings.loader import load_model_config

WEIGHTS = "adapter_model.safetensors"


def _meta(files: dict[str, Path]) -> Path:
    """The checkpoint's first JSON file besides PEFT's adapter_config.json."""
    return next(p for n, p in files.items() if n.endswith(".json") and "adapter_config" not in n)


def _truncate(files: dict[str, Path]) -> None:
    data = files[WEIGHTS].read_bytes()
    files[WEIGHTS].write_bytes(data[: len(data) // 2])


def _nan_with_a_matching_manifest(files: dict[str, Path]) -> None:
    """Issue 28: a NaN adapter checkpointed and resumed without a check (the manifest's hash is made to match)."""
    from safetensors.torch import load_file, save_file

    weights = files[WEIGHTS]
    tensors = load_file(str(weights))
    next(iter(tensors.values()))[0, 0] = float("nan")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    manifest = json.loads(files[MANIFEST_FILE].read_text())
    sha = hashlib.sha256(weights.read_bytes()).hexdigest()
    manifest["files"][weights.name] = {"bytes": weights.stat().st_size, "sha256": sha}
    files[MANIFEST_FILE].write_text(json.dumps(manifest))


SPOIL = {  # what -> how a saved checkpoint's files are spoilt (None: the folder is not there at all)
    "missing directory": None,
    "meta removed": lambda files: _meta(files).unlink(),
    "meta not JSON": lambda files: _meta(files).write_text("{broken"),
    "adapter weights removed": lambda files: files[WEIGHTS].unlink(),
    "weights truncated": _truncate,
    "optimizer state missing on resume": lambda files: None,  # saved without it
    "adapters hold NaN": _nan_with_a_matching_manifest,
}


@pytest.mark.parametrize("what", SPOIL)
def test_checkpoint(what, tmp_path, tiny_prepared, tiny_cfg):
    p = tiny_prepared()
    optimizer = make_optimizer(p.model, tiny_cfg.train, p.adapters)
    ckpt = save_adapter_checkpoint(
        p.model, tmp_path / "ckpt", step=7, optimizer=None if "optimizer" in what else optimizer
    )
    target = tmp_path / "nowhere" if SPOIL[what] is None else Path(ckpt)
    if SPOIL[what] is not None:
        SPOIL[what]({f.name: f for f in target.iterdir()})
    before = {n: a.detach().clone() for n, a in p.adapters.items()}
    with pytest.raises(Exception) as err:
        load_adapter_checkpoint(p.model, target, optimizer=optimizer)
    msg = str(err.value)
    assert str(target) in msg or target.name in msg or "optimizer state" in msg, msg
    assert all(torch.equal(a, before[n]) for n, a in p.adapters.items()), "a refused checkpoint changed adapters"


def test_adapters_holding_nan_are_not_checkpointed(tmp_path, tiny_prepared, tiny_cfg):
    p = tiny_prepared()
    with torch.no_grad():
        next(iter(p.adapters.values()))[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"not checkpointing step 7: 1 adapter\(s\) hold NaN/Inf"):
        save_adapter_checkpoint(
            p.model, tmp_path / "ckpt", step=7, optimizer=make_optimizer(p.model, tiny_cfg.train, p.adapters)
        )
    assert not (tmp_path / "ckpt").exists()


def test_a_local_path_without_a_config(tmp_path):
    """Issue 28: it fell back to random weights without a word."""
    cfg = dataclasses.replace(load_model_config("smollm2-135m", CONFIG_DIR), local_path=str(tmp_path))
    with pytest.raises(ValueError, match=r"holds no config\.json \(expected a Hugging"):
        build_model(cfg, "auto", torch.float32, "cpu")
