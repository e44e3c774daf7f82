"""The adapter round trip of the implementation under test (``lora_suite.judges.round_trip``): three training steps,
``save_adapter``, a fresh model, ``load_adapter``: the folder holds the trained tensors, the fresh model gets them
back bitwise and computes the trained logits bitwise; folders with a planted wrong lora_alpha, r or use_rslora are
refused (or honoured), never loaded as if they matched, on a model with rsLoRA too; folders whose weights do not fit (an adapter missing, a tensor of no
adapter, a shape changed) are refused; on a 16-bit base PEFT's own loader reads the same tensors and scale.
Tests that each build their own model, so that worker processes (``--workers``) can run them side by side."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from lora_suite.engine.models import build_model
from lora_suite.engine.prepare import DTYPES, adapter_spec
from lora_suite.judges import broken_folders as BF
from lora_suite.judges import peft_folder as PF
from lora_suite.judges import round_trip as RT

pytestmark = [pytest.mark.gpu, pytest.mark.quick, pytest.mark.model_code]
STEPS = 3  # enough to move every adapter (B starts at zero) and the logits bitwise


def test_adapters_survive_save_and_load(tier, tmp_path):
    cfg = tier.config("quick")
    trained = tier.prepare(cfg)
    RT.train_a_few(trained, STEPS, cfg.train.lr)
    folder = tmp_path / "adapter"
    for v in RT.round_trip(trained, lambda: tier.prepare(cfg), folder, tampered=()):
        tier.check(v.name, v.value, v.op, v.threshold, source=v.source, detail=v.detail)


@pytest.mark.parametrize("key", list(RT.TAMPERED))
def test_a_folder_with_a_wrong_setting_is_not_loaded_as_matching(tier, tmp_path, key):
    cfg = tier.config("quick")
    trained = tier.prepare(cfg)
    RT.train_a_few(trained, STEPS, cfg.train.lr)
    v = RT.tampered_folder(trained, lambda: tier.prepare(cfg), tmp_path / "adapter", key)
    tier.check(v.name, v.value, v.op, v.threshold, source=v.source, detail=v.detail)


def test_an_rslora_adapter_round_trips_and_its_setting_is_read(tier, tmp_path):
    """The same round trip on a model adapted with rsLoRA (scale alpha/sqrt(r)), then its folder with use_rslora
    flipped to false, which must not load as matching: a loader that remembered the setting of an earlier load (a
    value computed once and reused, issue 55) passes every round trip of a model without rsLoRA."""
    name = "rsLoRA: every round-trip check"
    if why := tier.impl.reason_not_applicable("rslora"):
        tier.check.not_applicable(name, why)
        return
    cfg = tier.config("quick")
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, use_rslora=True))
    trained = tier.prepare(cfg)
    RT.train_a_few(trained, STEPS, cfg.train.lr)
    for v in RT.round_trip(trained, lambda: tier.prepare(cfg), tmp_path / "adapter", tampered=("use_rslora",)):
        tier.check(f"rsLoRA: {v.name}", v.value, v.op, v.threshold, source=v.source, detail=v.detail)


def test_per_module_rank_and_alpha_round_trip(tier, tmp_path):
    """The round trip on a model whose last target takes its own r and alpha (PEFT's rank_pattern and alpha_pattern):
    the folder must record them, PEFT's loader must read the same tensors and scales, and a folder with another
    lora_alpha must not load as matching."""
    name = "per-module rank and alpha: every round-trip check"
    if why := tier.impl.reason_not_applicable("rank_pattern"):
        tier.check.not_applicable(name, why)
        return
    cfg = tier.config("quick")
    leaf = cfg.lora.targets[-1] if cfg.lora.targets != ("all-linear",) else "v_proj"
    lora = dataclasses.replace(cfg.lora, rank_pattern=(f"{leaf}={cfg.lora.r + 3}",), alpha_pattern=(f"{leaf}=7.3",))
    cfg = dataclasses.replace(cfg, lora=lora)
    trained = tier.prepare(cfg)
    RT.train_a_few(trained, STEPS, cfg.train.lr)
    folder = tmp_path / "adapter"
    verdicts = RT.round_trip(trained, lambda: tier.prepare(cfg), folder, tampered=("lora_alpha",))
    if not cfg.lora.quantize and importlib.util.find_spec("peft") is not None:  # PEFT's loader: on a 16-bit base

        def base():
            return build_model(cfg.model, cfg.weights, DTYPES[cfg.dtype], "cuda", seed=cfg.train.seed).model

        verdicts += PF.peft_loader(trained, base, folder, adapter_spec(cfg, None))
    for v in verdicts:
        tier.check(f"per-module rank and alpha: {v.name}", v.value, v.op, v.threshold, source=v.source, detail=v.detail)


@pytest.mark.parametrize("what", list(BF.BROKEN))
def test_a_folder_whose_weights_do_not_fit_is_refused(tier, tmp_path, what):
    cfg = tier.config("quick")
    trained = tier.prepare(cfg)
    v = BF.broken_folder(trained, lambda: tier.prepare(cfg), tmp_path / "adapter", what)
    tier.check(v.name, v.value, v.op, v.threshold, source=v.source, detail=v.detail)


def test_peft_loader_reads_the_saved_folder(tier, tmp_path):
    cfg = tier.config("quick")
    names = ("PEFT's loader on the saved folder: adapters bitwise the trained ones, every layer's scaling",)
    why = None
    try:
        import peft  # noqa: F401
    except ImportError as exc:
        why = f"peft does not import ({exc}): install lora-gpu-suite[peft]"
    if why is None and cfg.lora.quantize:
        why = f"the tier's base is {cfg.lora.quantize} ({tier.impl.name}'s storage): PEFT's loader is checked on 16-bit bases"
    if why:
        for name in names:
            tier.check.not_applicable(name, why)
        return

    trained = tier.prepare(cfg)
    RT.train_a_few(trained, STEPS, cfg.train.lr)
    folder = tmp_path / "adapter"
    trained.implementation.save_adapter(trained.model, folder)

    def base():
        return build_model(cfg.model, cfg.weights, DTYPES[cfg.dtype], "cuda", seed=cfg.train.seed).model

    for v in PF.peft_loader(trained, base, folder, adapter_spec(cfg, None)):
        tier.check(v.name, v.value, v.op, v.threshold, source=v.source, detail=v.detail)
