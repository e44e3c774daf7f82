"""The resumed-run check's engine (``lora_suite.engine.resume``) on the CPU: a tiny Llama of 12 decoder layers (so
that text order and number order of the layers differ), trained 40 steps by the torch reference with a checkpoint
after step 19, resumed in a fresh model. Complete, the resume reproduces the uninterrupted losses bit for bit (the
CPU's arithmetic is deterministic); with the planted text-order adapter list
(``lora_suite.scenarios.resume_layers_in_text_order``) the resumed steps leave the band that the by-name resume sets,
and the convergence tier's wider loss-match band (control runs with lora_A perturbed by the bf16 unit roundoff)
would have let them pass: why the resume has its own control."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lora_suite.engine.checkpoint import load_optimizer_state
from lora_suite.engine.gradients import perturb_lora_a
from lora_suite.engine.prepare import prepare
from lora_suite.engine.resume import CheckpointAt, resume, resume_by_name, train_with_checkpoint
from lora_suite.engine.trainer import train
from lora_suite.measure.criteria import loss_match, widest_control
from lora_suite.scenarios.resume_layers_in_text_order import TextOrderAfterLoad

AT = 20


@pytest.fixture
def deep_cfg(tiny_cfg):
    arch = dataclasses.replace(tiny_cfg.model.architecture, num_hidden_layers=12)
    return dataclasses.replace(tiny_cfg, model=dataclasses.replace(tiny_cfg.model, architecture=arch))


def _resumed(cfg, implementation, directory, kept=None):
    p = prepare(cfg, "cpu", implementation=implementation)
    step, result = resume(p, cfg.train, directory) if kept is None else resume_by_name(p, cfg.train, directory, kept)
    assert step == AT
    return result.losses


def _perturbed_controls(cfg):
    controls = []
    for seed in (99, 100, 101):
        p = prepare(cfg, "cpu", implementation="torch")
        perturb_lora_a(p.adapters, 2.0**-8, seed=seed)
        controls.append(train(p.model, p.batches, cfg.train, adapters=p.adapters).losses)
    return controls


def test_a_complete_resume_reproduces_the_uninterrupted_run_and_the_text_order_plant_leaves_the_band(
    deep_cfg, tmp_path
):
    result, kept = train_with_checkpoint(prepare(deep_cfg, "cpu"), deep_cfg.train, AT, tmp_path / "ckpt")
    uninterrupted = result.losses
    by_name = uninterrupted[:AT] + _resumed(deep_cfg, "torch", tmp_path / "ckpt", kept)
    assert by_name == uninterrupted
    clean = uninterrupted[:AT] + _resumed(deep_cfg, "torch", tmp_path / "ckpt")
    assert clean == uninterrupted
    assert loss_match(clean, uninterrupted, by_name, 4.0, 2.0**-10)[1] == []
    planted = uninterrupted[:AT] + _resumed(deep_cfg, TextOrderAfterLoad("torch"), tmp_path / "ckpt")
    assert planted[AT] == uninterrupted[AT]  # the adapters loaded right: the first resumed loss is the same
    beyond = loss_match(planted, uninterrupted, by_name, 4.0, 2.0**-10)[1]
    assert beyond and min(beyond) > AT
    wide = widest_control(_perturbed_controls(deep_cfg), uninterrupted)
    assert loss_match(planted, uninterrupted, wide, 4.0, 2.0**-10)[1] == []  # the tier's loss-match band: too wide


def test_the_checkpoint_is_written_once_after_the_step_before_it(deep_cfg, tmp_path):
    p = prepare(deep_cfg, "cpu")
    hook = CheckpointAt(3, tmp_path / "c", p, torch.optim.AdamW(p.adapters.values()))
    for step in (0, 1):
        hook(step)
    assert not hook.saved and not (tmp_path / "c").exists()
    hook(2)
    assert hook.saved and (tmp_path / "c" / "manifest.json").exists()
    with pytest.raises(ValueError, match="at >= 1"):
        CheckpointAt(0, tmp_path / "d", p, None)


def test_a_run_that_never_reaches_the_checkpoint_step_says_so(deep_cfg, tmp_path):
    with pytest.raises(RuntimeError, match="never reached step 40"):
        train_with_checkpoint(prepare(deep_cfg, "cpu"), deep_cfg.train, 41, tmp_path / "c")


def test_resuming_without_optimizer_state_names_the_missing_file(deep_cfg, tmp_path):
    p = prepare(deep_cfg, "cpu")
    with pytest.raises(FileNotFoundError, match="optimizer.pt"):
        load_optimizer_state(torch.optim.AdamW(p.adapters.values()), tmp_path)
