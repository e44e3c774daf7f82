"""Adapter checkpoints: the LoRA tensors in safetensors, plus optimizer state and step for resuming.

Layout of a checkpoint directory:
    adapter_model.safetensors   every lora_A / lora_B, keyed by its module path (metadata: step, r, alpha)
    optimizer.pt                AdamW state (only when saved with an optimizer)
    trainer_state.json          {"step": next step to run, ...}
Each file is written to a temporary name and renamed, so a crash never leaves a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lora_core.inject import adapter_parameters, lora_modules
from lora_core.report import atomic_write_text

ADAPTER_FILE = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"


def save_adapter_checkpoint(model: nn.Module, directory: str | Path, *, step: int,
                            optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in adapter_parameters(model).items()}
    if not tensors:
        raise ValueError("the model has no LoRA adapters to save (inject_lora first)")
    first = next(iter(lora_modules(model).values()))
    tmp = directory / f".{ADAPTER_FILE}.tmp"
    save_file(tensors, str(tmp), metadata={"step": str(step), "r": str(first.r), "alpha": str(first.alpha)})
    os.replace(tmp, directory / ADAPTER_FILE)
    if optimizer is not None:
        tmp = directory / f".{OPTIMIZER_FILE}.tmp"
        torch.save(optimizer.state_dict(), tmp)
        os.replace(tmp, directory / OPTIMIZER_FILE)
    atomic_write_text(directory / STATE_FILE, json.dumps({"step": step, **(extra or {})}, indent=1) + "\n")
    return directory


def load_adapter_checkpoint(model: nn.Module, directory: str | Path, *,
                            optimizer: torch.optim.Optimizer | None = None) -> int:
    """Load adapters (and optimizer state) into ``model``; return the step to resume from."""
    directory = Path(directory)
    path = directory / ADAPTER_FILE
    if not path.exists():
        raise FileNotFoundError(f"no adapter checkpoint at {path}")
    saved = load_file(str(path))
    params = adapter_parameters(model)
    missing, unexpected = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit the model: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]} ({len(missing)} / {len(unexpected)} in all)")
    with torch.no_grad():
        for name, p in params.items():
            if saved[name].shape != p.shape:
                raise ValueError(f"checkpoint {path}: {name} has shape {tuple(saved[name].shape)}, "
                                 f"the model's is {tuple(p.shape)}")
            p.copy_(saved[name])
    if optimizer is not None:
        opt_path = directory / OPTIMIZER_FILE
        if not opt_path.exists():
            raise FileNotFoundError(f"resuming needs optimizer state at {opt_path}")
        optimizer.load_state_dict(torch.load(opt_path, map_location="cpu", weights_only=True))
    return int(json.loads((directory / STATE_FILE).read_text())["step"])
