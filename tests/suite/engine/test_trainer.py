"""The training loop on the CPU with the tiny Llama and the torch backend."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lora_core.inject import adapter_parameters
from lora_suite.engine.checkpoint import load_adapter_checkpoint, save_adapter_checkpoint
from lora_suite.engine.optimizer import lr_at, make_optimizer
from lora_suite.engine.prepare import prepare
from lora_suite.engine.trainer import NonFiniteError, train
from lora_suite.measure.criteria import loss_drop
from lora_suite.settings.config import TrainSettings


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
    cfg = dataclasses.replace(
        tiny_cfg,
        train=dataclasses.replace(tiny_cfg.train, steps=3, grad_accum=2, gradient_checkpointing=True, warmup_steps=0),
        criteria=dataclasses.replace(tiny_cfg.criteria, loss_drop_min=None),  # no loss bar: its windows need 10 steps
    )
    p = prepare(cfg, "cpu")
    seen = []
    result = train(p.model, lambda i: seen.append(i) or p.batches(i), cfg.train)
    assert seen == [0, 1, 2, 3, 4, 5] and all(math.isfinite(x) for x in result.losses)


def test_optimizer_holds_exactly_the_adapters(tiny_cfg):
    p = prepare(tiny_cfg, "cpu")
    opt = make_optimizer(p.model, tiny_cfg.train)
    assert {id(q) for g in opt.param_groups for q in g["params"]} == {
        id(a) for a in adapter_parameters(p.model).values()
    }
    p.model.model.norm.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"parameters outside the adapters require grad: \['model.norm.weight'\]"):
        make_optimizer(p.model, tiny_cfg.train)


def test_non_finite_guard_names_the_parameters(tiny_cfg):
    p = prepare(tiny_cfg, "cpu")
    with torch.no_grad():
        p.model.model.layers[1].mlp.down_proj.lora_B.fill_(float("nan"))
    with pytest.raises(
        NonFiniteError, match=r"non-finite values at step 0.*NaN/Inf values: \['model.layers.1.mlp.down_proj.lora_B'\]"
    ):
        train(p.model, p.batches, tiny_cfg.train)


def test_non_finite_guard_names_a_frozen_base_tensor_and_a_batch_without_targets(tiny_cfg):
    """Issue 28: a NaN in a frozen base weight was blamed on the adapters, and a batch whose labels are all -100
    stopped with "loss nan" and no reason."""
    p = prepare(tiny_cfg, "cpu")
    with torch.no_grad():
        p.model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"frozen base holds NaN/Inf in \['model.layers.0.mlp.up_proj.weight'\]"):
        train(p.model, p.batches, tiny_cfg.train)
    p = prepare(tiny_cfg, "cpu")

    def no_targets(i):
        b = dict(p.batches(i))
        b["labels"] = torch.full_like(b["labels"], -100)
        return b

    with pytest.raises(NonFiniteError, match=r"micro-batch\(es\) \[0\] have no target token"):
        train(p.model, no_targets, tiny_cfg.train)


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
    cfg = dataclasses.replace(
        tiny_cfg,
        train=dataclasses.replace(tiny_cfg.train, steps=3, host_probe_ops=500, warmup_steps=0),
        criteria=dataclasses.replace(tiny_cfg.criteria, loss_drop_min=None),  # no loss bar: its windows need 10 steps
    )
    p = prepare(cfg, "cpu")
    records = train(p.model, p.batches, cfg.train).records
    assert all(r.host_probe_s is not None and r.host_probe_s > 0 for r in records)
    off = train(prepare(tiny_cfg, "cpu").model, p.batches, dataclasses.replace(cfg.train, host_probe_ops=0)).records
    assert all(r.host_probe_s is None for r in off)


# ------------------------------------------------------------------ captured steps (train.cuda_graph): the logic
def test_a_captured_run_needs_cuda_adapters_and_says_so(tiny_cfg):
    from lora_suite.engine.optimizer import make_optimizer

    cfg = dataclasses.replace(tiny_cfg.train, cuda_graph=True)
    p = prepare(tiny_cfg, "cpu")
    with pytest.raises(
        ValueError, match=r"train.cuda_graph: true needs the adapters on a CUDA device; they are on \['cpu'\]"
    ):
        make_optimizer(p.model, cfg, p.adapters)
    with pytest.raises(ValueError, match="needs the adapters on a CUDA device"):
        train(p.model, p.batches, cfg, adapters=p.adapters)


def test_capture_with_checkpointing_loads_and_checkpoints_without_the_rng_stash(config_dir):
    from lora_suite.engine.capture import checkpointing_kwargs
    from lora_suite.settings.loader import load_tier_config

    path = config_dir / "tiny.yaml"
    path.write_text(
        path.read_text().replace("log_every: 20}", "log_every: 20, cuda_graph: true, gradient_checkpointing: true}")
    )
    cfg = load_tier_config(path)
    model = prepare(cfg, "cpu").model
    assert checkpointing_kwargs(model, cfg.train) == {"use_reentrant": False, "preserve_rng_state": False}
    eager = dataclasses.replace(cfg.train, cuda_graph=False)
    assert checkpointing_kwargs(model, eager) == {"use_reentrant": False}  # eager keeps the RNG stash


def test_capture_with_checkpointing_refuses_a_model_with_dropout_naming_it(tiny_cfg):
    from lora_suite.engine.capture import checkpointing_kwargs, random_in_training

    model = prepare(tiny_cfg, "cpu").model
    assert random_in_training(model) == []
    s = dataclasses.replace(tiny_cfg.train, cuda_graph=True, gradient_checkpointing=True)
    model.config.attention_dropout = 0.1
    model.model.layers[0].mlp.drop = torch.nn.Dropout(0.2)
    assert random_in_training(model) == ["model.layers.0.mlp.drop (p=0.2)", "config.attention_dropout=0.1"]
    with pytest.raises(
        ValueError,
        match=r"needs a model without dropout in training mode .*found "
        r"\['model.layers.0.mlp.drop \(p=0.2\)', 'config.attention_dropout=0.1'\]",
    ):
        checkpointing_kwargs(model, s)


def test_static_batches_copy_in_and_refuse_other_shapes():
    from lora_suite.engine.capture import StaticBatches

    first = [{"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8, dtype=torch.long)}]
    static = StaticBatches(first)
    nxt = [{"input_ids": torch.ones(2, 8, dtype=torch.long), "labels": torch.full((2, 8), 7)}]
    (buf,) = static.load(nxt, step=5)
    assert buf["input_ids"].data_ptr() == static.buffers[0]["input_ids"].data_ptr() and int(buf["labels"].sum()) == 112
    with pytest.raises(
        ValueError,
        match=r"step 6, micro-batch 0: input_ids is \(2, 9\) torch.int64, the captured step "
        r"takes \(2, 8\) torch.int64 \(cuda_graph needs static shapes",
    ):
        static.load(
            [{"input_ids": torch.ones(2, 9, dtype=torch.long), "labels": torch.ones(2, 9, dtype=torch.long)}], 6
        )
    with pytest.raises(ValueError, match="step 7: 2 micro-batches, the captured step has 1"):
        static.load(nxt * 2, 7)


def test_set_lr_writes_into_a_tensor_lr_in_place_and_assigns_a_float():
    from lora_suite.engine.optimizer import set_lr

    w = torch.nn.Parameter(torch.zeros(2))
    lr = torch.tensor(1e-3)
    tensor_opt = torch.optim.AdamW([w], lr=lr)
    set_lr(tensor_opt, 5e-4)
    assert tensor_opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(5e-4)
    float_opt = torch.optim.AdamW([w], lr=1e-3)
    set_lr(float_opt, 2e-4)
    assert float_opt.param_groups[0]["lr"] == 2e-4


def test_eager_records_say_they_were_not_replayed(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg.train, steps=2, warmup_steps=0)
    p = prepare(tiny_cfg, "cpu")
    assert [r.captured for r in train(p.model, p.batches, cfg).records] == [False, False]


def test_the_graph_warm_up_must_leave_steps_to_capture_only_when_capturing(config_dir):
    from lora_suite.settings.config import ConfigError
    from lora_suite.settings.loader import load_tier_config

    path = config_dir / "tiny.yaml"
    text = path.read_text()
    path.write_text(
        text.replace("steps: 40,", "steps: 2,")
        .replace("warmup_steps: 4", "warmup_steps: 0")
        .replace("criteria: {loss_drop_min: 0.02, loss_window: 5}", "criteria: {loss_window: 1}")
    )
    assert load_tier_config(path).train.steps == 2  # no capture: the default warm-up (3) does not matter
    path.write_text(text.replace("log_every: 20}", "log_every: 20, cuda_graph: true, graph_warmup_steps: 40}"))
    with pytest.raises(ConfigError, match="train.graph_warmup_steps: 40 is out of range"):
        load_tier_config(path)


def test_the_guard_stops_a_stack_that_cleans_its_gradients(tiny_cfg):
    """Issue 55: a stack whose adapters' gradients pass through nan_to_num (example_plants_values) trains on with
    finite gradients once a NaN enters; the guard still stops it at that step, from the loss, naming the frozen tensor."""
    from lora_suite.scenarios import example_plants as EP

    cfg = dataclasses.replace(tiny_cfg, dtype="float32")
    p = prepare(cfg, "cpu", implementation=EP.adapter_grads_nan_to_num())
    with torch.no_grad():
        p.model.model.layers[0].mlp.up_proj.base.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"non-finite values at step 0: loss nan.*frozen base holds NaN/Inf"):
        train(p.model, p.batches, cfg.train, adapters=p.adapters)
