"""Adapter checkpoints, written as a unit: the LoRA tensors, optimizer state and step, or nothing.

Layout of a checkpoint directory:
    adapter_model.safetensors   every lora_A / lora_B, keyed by its module path (metadata: step, r, alpha)
    optimizer.pt                AdamW state (only when saved with an optimizer)
    trainer_state.json          {"step": next step to run, ...}
    manifest.json               written last: {"step", "files": {name: {"bytes", "sha256"}}}

Why a unit: written file by file into the live directory, a save killed between two renames left the
adapters of step N+1 beside the optimizer state of step N, and resuming from that mixed set was silent
(26 of 30 kills in issue 8). Now every file goes into a fresh temporary sibling directory, fsynced, the
manifest last; then the directory is renamed into place (the previous checkpoint first renamed aside and
removed after). A reader sees the old checkpoint or the new one. The loader refuses a directory without a
manifest, a file whose size or SHA-256 differs from it, and files whose steps disagree, naming them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from lora_core.inject import adapter_parameters, lora_modules

ADAPTER_FILE = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint directory is partial, mixed or corrupt; the message names the file and what is wrong."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_adapter_checkpoint(model: nn.Module, directory: str | Path, *, step: int,
                            optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None) -> Path:
    directory = Path(directory)
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in adapter_parameters(model).items()}
    if not tensors:
        raise ValueError("the model has no LoRA adapters to save (inject_lora first)")
    directory.parent.mkdir(parents=True, exist_ok=True)
    for stale in directory.parent.glob(f".{directory.name}.tmp-*"):  # left by a save that was killed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        first = next(iter(lora_modules(model).values()))
        save_file(tensors, str(tmp / ADAPTER_FILE), metadata={"step": str(step), "r": str(first.r),
                                                               "alpha": str(first.alpha)})
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **(extra or {})}, indent=1) + "\n")
        files = {}
        for path in sorted(tmp.iterdir()):
            _fsync(path)
            files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        (tmp / MANIFEST_FILE).write_text(json.dumps({"step": step, "files": files}, indent=1) + "\n")
        _fsync(tmp / MANIFEST_FILE)
        old = None
        if directory.exists():
            old = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(directory, old)
        os.replace(tmp, directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def verify_checkpoint(directory: str | Path) -> int:
    """Check the manifest, every file's size and SHA-256, and that all steps agree; return the step."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST_FILE
    if not (directory / ADAPTER_FILE).exists() and not manifest_path.exists():
        aside = sorted(directory.parent.glob(f".{directory.name}.old-*"))
        hint = (f"; a save was interrupted between its two renames and the previous checkpoint is whole at "
                f"{aside[-1]} (rename it to {directory.name} to resume from it)") if aside else ""
        raise FileNotFoundError(f"no adapter checkpoint at {directory / ADAPTER_FILE}{hint}")
    if not manifest_path.exists():
        raise CheckpointError(f"checkpoint {directory} has no {MANIFEST_FILE}: it is partial (a save did not "
                              "finish) or was written by hand; refusing to resume from it")
    manifest = json.loads(manifest_path.read_text())
    for name, want in manifest["files"].items():
        path = directory / name
        if not path.exists():
            raise CheckpointError(f"checkpoint {directory}: {name} is listed in the manifest but missing")
        size = path.stat().st_size
        if size != want["bytes"] or _sha256(path) != want["sha256"]:
            raise CheckpointError(f"checkpoint {directory}: {name} differs from the manifest of step "
                                  f"{manifest['step']} ({size} bytes, expected {want['bytes']}; or its SHA-256): "
                                  "a mixed or corrupted set")
    for name in (ADAPTER_FILE, STATE_FILE):
        if name not in manifest["files"]:
            raise CheckpointError(f"checkpoint {directory}: the manifest lists no {name}")
    with safe_open(str(directory / ADAPTER_FILE), "pt") as f:
        adapter_step = int((f.metadata() or {}).get("step", -1))
    state_step = int(json.loads((directory / STATE_FILE).read_text())["step"])
    if not adapter_step == state_step == manifest["step"]:
        raise CheckpointError(f"checkpoint {directory}: steps disagree (adapters {adapter_step}, trainer state "
                              f"{state_step}, manifest {manifest['step']})")
    return manifest["step"]


def load_adapter_checkpoint(model: nn.Module, directory: str | Path, *,
                            optimizer: torch.optim.Optimizer | None = None) -> int:
    """Load adapters (and optimizer state) into ``model`` after ``verify_checkpoint``; return the step."""
    directory = Path(directory)
    step = verify_checkpoint(directory)
    path = directory / ADAPTER_FILE
    saved = load_file(str(path))
    params = adapter_parameters(model)
    missing, unexpected = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit the model: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]} ({len(missing)} / {len(unexpected)} in all)")
    for name, p in params.items():
        if saved[name].shape != p.shape:
            raise ValueError(f"checkpoint {path}: {name} has shape {tuple(saved[name].shape)}, "
                             f"the model's is {tuple(p.shape)}")
    if optimizer is not None:
        opt_path = directory / OPTIMIZER_FILE
        if not opt_path.exists():
            raise FileNotFoundError(f"resuming needs optimizer state at {opt_path}")
        optimizer.load_state_dict(torch.load(opt_path, map_location="cpu", weights_only=True))
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(saved[name])
    return step
