"""Adapter checkpoints: safetensors round trip and the errors for a checkpoint that does not fit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lora_core.inject import adapter_parameters, inject_lora
from lora_suite.engine.checkpoint import ADAPTER_FILE, STATE_FILE, load_adapter_checkpoint, save_adapter_checkpoint
from lora_suite.engine.models import build_random
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
    ck = save_adapter_checkpoint(a, tmp_path / "ck", step=3, extra={"note": "x"})
    saved = load_file(str(ck / ADAPTER_FILE))
    assert set(saved) == {f"base_model.model.{n}.weight" for n in adapter_parameters(a)}  # PEFT's key names
    assert json.loads((ck / STATE_FILE).read_text())["step"] == 3
    assert not list(tmp_path.glob(".*tmp*")), "temporary files left behind"
    b = _model()
    assert load_adapter_checkpoint(b, ck) == 3
    assert all(torch.equal(p, adapter_parameters(a)[n]) for n, p in adapter_parameters(b).items())


def test_mismatches_are_named(tmp_path):
    tmp_path = save_adapter_checkpoint(_model(), tmp_path / "ck", step=1)
    with pytest.raises(
        ValueError, match=r"layers without weights \['base_model.model.model.layers.0.self_attn.k_proj.lora_A"
    ):
        load_adapter_checkpoint(_model(("q_proj", "k_proj", "v_proj")), tmp_path)
    with pytest.raises(ValueError, match=r"has r=4, alpha=16.* but r=2"):
        load_adapter_checkpoint(_model(r=2), tmp_path)
    with pytest.raises(FileNotFoundError, match="resuming needs optimizer state"):
        m = _model()
        load_adapter_checkpoint(m, tmp_path, optimizer=torch.optim.AdamW(adapter_parameters(m).values()))
    with pytest.raises(FileNotFoundError, match="no adapter checkpoint"):
        load_adapter_checkpoint(_model(), tmp_path / "missing")


def test_a_save_killed_midway_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    """Issue 8: a kill between files left step-N+1 adapters beside step-N optimizer state, resumed silently."""
    from lora_suite.engine import checkpoint as C

    m = _model()
    opt = torch.optim.AdamW(adapter_parameters(m).values())
    save_adapter_checkpoint(m, tmp_path / "ck", step=5, optimizer=opt)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed while saving the optimizer state")

    monkeypatch.setattr(C.torch, "save", killed)
    with torch.no_grad():
        for p in adapter_parameters(m).values():
            p.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        save_adapter_checkpoint(m, tmp_path / "ck", step=6, optimizer=opt)
    monkeypatch.undo()
    assert load_adapter_checkpoint(_model(), tmp_path / "ck") == 5
    assert [p.name for p in tmp_path.iterdir()] == ["ck"], "temporary directories left behind"


def test_a_mixed_set_is_refused_naming_the_file(tmp_path):
    m = _model()
    save_adapter_checkpoint(m, tmp_path / "a", step=5)
    with torch.no_grad():
        for p in adapter_parameters(m).values():
            p.add_(1.0)  # one more optimizer step's worth of change
    save_adapter_checkpoint(m, tmp_path / "b", step=6)
    (tmp_path / "a" / ADAPTER_FILE).write_bytes((tmp_path / "b" / ADAPTER_FILE).read_bytes())
    from lora_suite.engine.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=r"adapter_model.safetensors differs from the manifest of step 5"):
        load_adapter_checkpoint(_model(), tmp_path / "a")


def test_a_directory_without_manifest_is_refused(tmp_path):
    from lora_suite.engine.checkpoint import MANIFEST_FILE, CheckpointError

    save_adapter_checkpoint(_model(), tmp_path / "ck", step=2)
    (tmp_path / "ck" / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match="has no manifest.json: it is partial"):
        load_adapter_checkpoint(_model(), tmp_path / "ck")


KILL_LOOP = """
import sys, torch
sys.path.insert(0, {root!r})
from lora_suite.engine.checkpoint import save_adapter_checkpoint
from lora_core.inject import adapter_parameters, inject_lora
from lora_suite.engine.models import build_random
from tests.conftest import TINY_ARCH
m = build_random(TINY_ARCH, torch.float32, "cpu")
inject_lora(m, ("q_proj", "v_proj"), r=4)
opt = torch.optim.AdamW(adapter_parameters(m).values())
print("ready", flush=True)
step = 0
while True:
    step += 1
    with torch.no_grad():
        for p in adapter_parameters(m).values():
            p.fill_(float(step))
    save_adapter_checkpoint(m, {ck!r}, step=step, optimizer=opt)
"""


def test_real_kills_during_saves_never_leave_a_mixed_set(tmp_path):
    """SIGKILL a process that saves in a loop, at several moments: what loads is always one whole step."""
    import random
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[3])
    ck = tmp_path / "ck"
    rng = random.Random(0)
    for _ in range(5):
        proc = subprocess.Popen(
            [sys.executable, "-c", KILL_LOOP.format(root=root, ck=str(ck))], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if not ck.exists():
            continue  # killed before the first save, or between the two renames: nothing claims a step
        m = _model()
        step = load_adapter_checkpoint(m, ck)
        assert all(torch.all(p == float(step)) for p in adapter_parameters(m).values())
