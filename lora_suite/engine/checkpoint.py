"""Training checkpoints, written as a unit: PEFT-format adapters, optimizer state and step, or nothing.

Layout of a checkpoint directory (the adapters are a PEFT folder: ``peft.PeftModel.from_pretrained`` loads it):
    adapter_model.safetensors   PEFT keys, base_model.model.<module path>.lora_A/B.weight (lora_core.adapters)
    adapter_config.json         PEFT's LoRA config: r, lora_alpha, target_modules, ...
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
from torch import nn

from lora_core.adapters import CONFIG_FILE, load_peft_adapter, save_peft_adapter
from lora_core.inject import adapter_parameters

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


def save_adapter_checkpoint(
    model: nn.Module,
    directory: str | Path,
    *,
    step: int,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict | None = None,
    implementation=None,
) -> Path:
    """Write the checkpoint as a unit. ``implementation`` (lora_suite.implementations) writes the PEFT-format
    adapters; default: lora_core's layers (``save_peft_adapter``)."""
    directory = Path(directory)
    adapters = implementation.adapter_parameters(model) if implementation else adapter_parameters(model)
    if not adapters:
        raise ValueError("the model has no LoRA adapters to save (inject_lora first)")
    bad = {n: int((~torch.isfinite(p.detach())).sum()) for n, p in adapters.items()}
    bad = {n: k for n, k in bad.items() if k}
    if bad:
        first = next(iter(bad))
        raise ValueError(
            f"not checkpointing step {step}: {len(bad)} adapter(s) hold NaN/Inf ({first}: {bad[first]} value(s)); "
            "a checkpoint of them would resume a broken run"
        )
    directory.parent.mkdir(parents=True, exist_ok=True)
    for stale in directory.parent.glob(f".{directory.name}.tmp-*"):  # left by a save that was killed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if implementation is not None:
            implementation.save_adapter(model, tmp)
        else:
            save_peft_adapter(model, tmp)
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
        hint = (
            (
                f"; a save was interrupted between its two renames and the previous checkpoint is whole at "
                f"{aside[-1]} (rename it to {directory.name} to resume from it)"
            )
            if aside
            else ""
        )
        raise FileNotFoundError(f"no adapter checkpoint at {directory / ADAPTER_FILE}{hint}")
    if not manifest_path.exists():
        raise CheckpointError(
            f"checkpoint {directory} has no {MANIFEST_FILE}: it is partial (a save did not "
            "finish) or was written by hand; refusing to resume from it"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        files, step = dict(manifest["files"]), int(manifest["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {directory}: {MANIFEST_FILE} is not a manifest (expected JSON with "
            f"'files' and 'step'; {type(exc).__name__}: {exc})"
        ) from None
    for name, want in files.items():
        path = directory / name
        if not path.exists():
            raise CheckpointError(f"checkpoint {directory}: {name} is listed in the manifest but missing")
        size = path.stat().st_size
        if size != want["bytes"] or _sha256(path) != want["sha256"]:
            raise CheckpointError(
                f"checkpoint {directory}: {name} differs from the manifest of step "
                f"{step} ({size} bytes, expected {want['bytes']}; or its SHA-256): "
                "a mixed or corrupted set"
            )
    for name in (ADAPTER_FILE, CONFIG_FILE, STATE_FILE):
        if name not in files:
            raise CheckpointError(f"checkpoint {directory}: the manifest lists no {name}")
    state_step = int(json.loads((directory / STATE_FILE).read_text())["step"])
    if state_step != step:
        raise CheckpointError(f"checkpoint {directory}: steps disagree (trainer state {state_step}, manifest {step})")
    return step


def load_adapter_checkpoint(
    model: nn.Module, directory: str | Path, *, optimizer: torch.optim.Optimizer | None = None, implementation=None
) -> int:
    """Load adapters (and optimizer state) into ``model`` after ``verify_checkpoint``; return the step."""
    directory = Path(directory)
    step = verify_checkpoint(directory)
    opt_path = directory / OPTIMIZER_FILE
    if optimizer is not None and not opt_path.exists():
        raise FileNotFoundError(f"resuming needs optimizer state at {opt_path}")
    from safetensors.torch import load_file

    bad = [k for k, t in load_file(str(directory / ADAPTER_FILE)).items() if not torch.isfinite(t).all()]
    if bad:
        raise CheckpointError(
            f"checkpoint {directory}: {len(bad)} adapter tensor(s) hold NaN/Inf ({bad[0]}): not resumed"
        )
    if implementation is not None:
        implementation.load_adapter(model, directory)
    else:
        load_peft_adapter(model, directory)  # checks keys, shapes, r and alpha before it copies anything
    if optimizer is not None:
        load_optimizer_state(optimizer, directory)
    return step


def load_optimizer_state(optimizer: torch.optim.Optimizer, directory: str | Path) -> None:
    """Load the optimizer state of checkpoint ``directory`` into ``optimizer``. torch keys that state by the position
    of each parameter in the optimizer's list, so ``optimizer`` must list the adapters in the order of the run that
    saved it (a list in another order gives each tensor another one's moments: the resumed-run check's defect)."""
    opt_path = Path(directory) / OPTIMIZER_FILE
    if not opt_path.exists():
        raise FileNotFoundError(f"resuming needs optimizer state at {opt_path}")
    optimizer.load_state_dict(torch.load(opt_path, map_location="cpu", weights_only=True))
