"""Adapter folders that do not fit the model, which ``load_adapter`` must refuse (``BROKEN``, judged by
``broken_folder``): an adapter missing, a tensor that fits no adapter, an adapter of another shape, a config that is
absent or unreadable; a folder holding only part of the adapters (one layer's pair gone, only half the layers
kept: every pair left complete and of the right shape). A loader that takes the rest leaves a layer as it was (peft#2773: weights silently not loaded),
reads a tensor into a layer of another shape, or loads weights under settings it guessed. Each defect is planted in a
copy of the saved folder (``copy_beside``) and loaded into a fresh model (``load_fresh``, which names the refusal);
``lora_suite.judges.round_trip`` plants its wrong configs the same way."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from lora_suite.engine.prepare import Prepared
from lora_suite.judges.peft_folder import CONFIG_FILE, PEFT_PREFIX, WEIGHTS_FILE
from lora_suite.measure.criteria import Verdict


def _tensors(change: Callable[[dict], dict]) -> Callable[[Path], None]:
    """A folder change that rewrites the saved tensors with ``change``."""

    def apply(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = change(load_file(str(folder / WEIGHTS_FILE)))
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(folder / WEIGHTS_FILE), metadata={"format": "pt"}
        )

    return apply


def _drop_one(tensors: dict) -> dict:
    return dict(list(tensors.items())[:-1])


def _drop_layer(tensors: dict) -> dict:
    """Both adapters (A and B) of the first adapted layer gone: every pair left is complete."""
    first = next(iter(tensors)).rsplit(".lora_", 1)[0]
    return {k: v for k, v in tensors.items() if k.rsplit(".lora_", 1)[0] != first}


def _keep_half(tensors: dict) -> dict:
    """Only the first half of the adapted layers' pairs kept (a save cut short, a shard of a sharded save)."""
    layers = list(dict.fromkeys(k.rsplit(".lora_", 1)[0] for k in tensors))
    kept = set(layers[: max(1, len(layers) // 2)])
    return {k: v for k, v in tensors.items() if k.rsplit(".lora_", 1)[0] in kept}


def _add_unknown(tensors: dict) -> dict:
    some = next(iter(tensors.values()))
    return {**tensors, f"{PEFT_PREFIX}model.no_such_module.lora_A.weight": torch.zeros_like(some)}


def _reshape_one(tensors: dict) -> dict:
    key, t = next(iter(tensors.items()))
    return {**tensors, key: torch.cat([t, t[:1]])}  # one row more: another rank's or another layer's tensor


def _config_text(text: str | None) -> Callable[[Path], None]:
    """A folder change that replaces the config file with ``text`` (None: removes it)."""

    def apply(folder: Path) -> None:
        if text is None:
            (folder / CONFIG_FILE).unlink()
        else:
            (folder / CONFIG_FILE).write_text(text)

    return apply


# A folder that does not fit the model: what -> how the saved folder is changed. Each must be refused: a loader that
# takes the rest leaves a layer as it was (peft#2773: weights silently not loaded), reads a tensor into a layer of
# another shape, or loads weights under settings it guessed (no config, or one it could not read).
BROKEN = {
    "an adapter missing": _tensors(_drop_one),
    "one layer's adapters missing": _tensors(_drop_layer),
    "half the layers' adapters missing": _tensors(_keep_half),
    "a tensor that fits no adapter": _tensors(_add_unknown),
    "an adapter of another shape": _tensors(_reshape_one),
    "no adapter_config.json": _config_text(None),
    "an adapter_config.json that is not JSON": _config_text('{"r": 8, "lora_alpha":'),
    "an adapter_config.json that is a JSON list": _config_text("[]"),
}


def broken_folder(trained: Prepared, build: Callable[[], Prepared], folder: Path, what: str) -> Verdict:
    """``trained`` saved to ``folder``, then a copy broken as ``BROKEN[what]`` says, loaded into a fresh model: it
    must be refused."""
    if what not in BROKEN:
        raise ValueError(f"broken_folder: {what!r} is not one of {sorted(BROKEN)}")
    trained.implementation.save_adapter(trained.model, folder)
    bad = copy_beside(folder, "broken-" + "".join(c if c.isalnum() else "-" for c in what))
    BROKEN[what](bad)
    _, refusal = load_fresh(build, bad)
    return Verdict(
        f"folder with {what}: refused (never loaded in part)",
        refusal is not None,
        "==",
        True,
        "a folder that does not fit the model, or whose settings cannot be read, is not the trained adapter "
        "(peft#2773)",
        f"refused: {refusal}" if refusal else "loaded without an error",
    )


def copy_beside(folder: Path, suffix: str) -> Path:
    """A copy of ``folder`` beside it, to plant a defect in."""
    bad = folder.with_name(f"{folder.name}-{suffix}")
    shutil.copytree(folder, bad, dirs_exist_ok=True)
    return bad


def load_fresh(build: Callable[[], Prepared], folder: Path) -> tuple[Prepared, str | None]:
    """A fresh model with ``folder`` loaded into it, and the loader's refusal (its error, named; None: it loaded)."""
    fresh = build()
    try:
        fresh.implementation.load_adapter(fresh.model, folder)
    except Exception as exc:  # noqa: BLE001  (a refusal is an answer the callers judge; it is named)
        return fresh, f"{type(exc).__name__}: {str(exc)[:200]}"
    return fresh, None
