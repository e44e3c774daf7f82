"""The training loop on the CPU with the tiny Llama and the torch backend."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lora_suite.checkpoint import load_adapter_checkpoint, save_adapter_checkpoint
from lora_suite.config import TrainSettings
from lora_suite.criteria import loss_drop
from lora_core.inject import adapter_parameters
from lora_suite.prepare import prepare
from lora_suite.trainer import NonFiniteError, lr_at, make_optimizer, train


def test_lr_schedule():
    s = TrainSettings(steps=11, lr=1.0, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    assert [lr_at(i, s) for i in (0, 1)] == [0.5, 1.0]
    assert lr_at(2, s) == pytest.approx(1.0) and lr_at(10, s) == pytest.approx(0.1)
    assert lr_at(6, s) == pytest.approx(0.55)  # halfway through the cosine
    lin = dataclasses.replace(s, schedule="linear")
    assert lr_at(6, lin) == pytest.approx(0.55) and lr_at(10, lin) == pytest.approx(0.1)
    assert lr_at(9, dataclasses.replace(s, schedule="constant")) == 1.0


def test_tiny_llama_loss_falls_and_records_are_complete(tiny_cfg):
    p = prepare(tiny_cfg, "cpu")
    result = train(p.model, p.batches, tiny_cfg.train)
    assert len(result.records) == tiny_cfg.train.steps
    assert loss_drop(result.losses, tiny_cfg.criteria.loss_window) >= tiny_cfg.criteria.loss_drop_min
    r = result.records[-1]
    assert r.tokens_per_s > 0 and r.step_time_s > 0 and math.isfinite(r.grad_norm) and r.nvml_used_mib is None


def test_gradient_accumulation_and_checkpointing_run(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, train=dataclasses.replace(tiny_cfg.train, steps=3, grad_accum=2,
                                                                  gradient_checkpointing=True, warmup_steps=0))
    p = prepare(cfg, "cpu")
    seen = []
    result = train(p.model, lambda i: seen.append(i) or p.batches(i), cfg.train)
    assert seen == [0, 1, 2, 3, 4, 5] and all(math.isfinite(x) for x in result.losses)


def test_optimizer_holds_exactly_the_adapters(tiny_cfg):
    p = prepare(tiny_cfg, "cpu")
    opt = make_optimizer(p.model, tiny_cfg.train)
    assert {id(q) for g in opt.param_groups for q in g["params"]} == {id(a) for a in adapter_parameters(p.model).values()}
    p.model.model.norm.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"parameters outside the adapters require grad: \['model.norm.weight'\]"):
        make_optimizer(p.model, tiny_cfg.train)


def test_non_finite_guard_names_the_parameters(tiny_cfg):
    p = prepare(tiny_cfg, "cpu")
    with torch.no_grad():
        p.model.model.layers[1].mlp.down_proj.lora_B.fill_(float("nan"))
    with pytest.raises(NonFiniteError, match=r"non-finite values at step 0.*NaN/Inf values: \['model.layers.1.mlp.down_proj.lora_B'\]"):
        train(p.model, p.batches, tiny_cfg.train)


def test_resume_from_checkpoint_continues_identically(tiny_cfg, tmp_path):
    cfg = dataclasses.replace(tiny_cfg, train=dataclasses.replace(tiny_cfg.train, steps=12))
    straight = train(prepare(cfg, "cpu").model, prepare(cfg, "cpu").batches, cfg.train).losses

    first = prepare(cfg, "cpu")
    head = train(first.model, first.batches, cfg.train, stop_step=6)
    save_adapter_checkpoint(first.model, tmp_path / "ck", step=6, optimizer=head.optimizer)
    second = prepare(cfg, "cpu")
    opt = make_optimizer(second.model, cfg.train)
    start = load_adapter_checkpoint(second.model, tmp_path / "ck", optimizer=opt)
    tail = train(second.model, second.batches, cfg.train, optimizer=opt, start_step=start)
    assert start == 6
    assert head.losses + tail.losses == pytest.approx(straight, rel=1e-6, abs=1e-6)


def test_a_non_finite_stop_keeps_the_records_before_it(tiny_cfg):
    """Issue 8: the per-step records before a NaN stop were dropped with the exception."""
    p = prepare(tiny_cfg, "cpu")
    name = "model.layers.0.self_attn.q_proj.lora_A"

    def poison(step):
        if step == 3:
            with torch.no_grad():
                adapter_parameters(p.model)[name].fill_(float("nan"))

    records = []
    with pytest.raises(NonFiniteError, match=name):
        train(p.model, p.batches, tiny_cfg.train, records=records, step_hook=poison)
    assert [r.step for r in records] == [0, 1, 2, 3]
    assert all(r.cpu_time_s is not None and r.cpu_time_s > 0 for r in records)


def test_the_host_probe_is_recorded_after_each_step_when_configured(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, train=dataclasses.replace(tiny_cfg.train, steps=3, host_probe_ops=500,
                                                                  warmup_steps=0))
    p = prepare(cfg, "cpu")
    records = train(p.model, p.batches, cfg.train).records
    assert all(r.host_probe_s is not None and r.host_probe_s > 0 for r in records)
    off = train(prepare(tiny_cfg, "cpu").model, p.batches, dataclasses.replace(cfg.train, host_probe_ops=0)).records
    assert all(r.host_probe_s is None for r in off)
