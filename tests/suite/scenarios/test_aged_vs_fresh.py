"""lora_suite.scenarios.aged_vs_fresh on the CPU with the tiny Llama: the pairs' order and steps, and a planted state-growth
defect that the verdict must catch (the unplanted side is replayed from GPU runs in test_long_run.py)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import lora_core.layer as layer_module
from lora_suite.engine.prepare import prepare
from lora_suite.engine.trainer import TrainingRun, train
from lora_suite.measure.criteria import aged_vs_fresh_verdict
from lora_suite.scenarios.aged_vs_fresh import run_pairs
from lora_suite.scenarios.long_run import aged_vs_fresh_resolved


def _aged_and_fresh(cfg):
    aged = prepare(cfg, "cpu")
    result = train(aged.model, aged.batches, cfg.train)
    fresh = prepare(cfg, "cpu")
    return result, TrainingRun(fresh.model, fresh.batches, cfg.train, adapters=fresh.adapters)


def _short_aged_and_fresh(tiny_cfg, steps):
    """_aged_and_fresh of tiny_cfg trained ``steps`` steps after 2 warm-up steps, without a loss bar (its windows
    need 10 steps)."""
    cfg = dataclasses.replace(
        tiny_cfg,
        train=dataclasses.replace(tiny_cfg.train, steps=steps, warmup_steps=2),
        criteria=dataclasses.replace(tiny_cfg.criteria, loss_drop_min=None),
    )
    return _aged_and_fresh(cfg)


def test_pairs_alternate_their_order_and_leave_the_records_alone(tiny_cfg):
    result, fresh = _short_aged_and_fresh(tiny_cfg, steps=6)
    pairs = run_pairs(result.run, fresh, aged_start=6, pairs=4, warmup=2)
    assert [p.aged_first for p in pairs] == [True, False, True, False]
    assert [p.aged_step for p in pairs] == [6, 7, 8, 9] and [p.fresh_step for p in pairs] == [2, 3, 4, 5]
    assert len(result.records) == 6 and fresh.records == []
    assert all(p.aged_cpu_s > 0 and p.fresh_cpu_s > 0 and p.aged_span_s is None for p in pairs)
    assert not result.run.model.training  # the runs leave their models in eval mode, as train() does
    rounds = run_pairs(result.run, fresh, aged_start=10, pairs=2, warmup=0, repeats=3)  # 3 rounds per pair
    assert [(p.aged_step, p.fresh_step, p.aged_first) for p in rounds] == [(10, 0, True), (13, 3, False)]
    with pytest.raises(ValueError, match="max_pairs >= pairs, block >= 2 and repeats >= 1, got pairs=1"):
        run_pairs(result.run, fresh, aged_start=6, pairs=1, warmup=0)
    with pytest.raises(ValueError, match="repeats=0"):
        run_pairs(result.run, fresh, aged_start=6, pairs=2, warmup=0, repeats=0)


def test_more_pairs_are_run_until_resolved_or_the_cap(tiny_cfg):
    result, fresh = _short_aged_and_fresh(tiny_cfg, steps=4)
    seen = []
    never = run_pairs(
        result.run,
        fresh,
        aged_start=4,
        pairs=4,
        warmup=0,
        max_pairs=9,
        block=2,
        resolved=lambda done: seen.append(len(done)) and False,
    )
    assert seen == [4, 6, 8] and len(never) == 9
    assert [p.aged_first for p in never] == [i % 2 == 0 for i in range(9)]
    assert [p.aged_step for p in never] == list(range(4, 13))
    at_once = run_pairs(result.run, fresh, aged_start=13, pairs=4, warmup=0, max_pairs=9, resolved=lambda done: True)
    assert len(at_once) == 4


def test_host_work_that_grows_with_the_models_own_state_fails_the_pairs(tiny_cfg, monkeypatch):
    """Every LoRA layer walks a history of its own calls on each forward (50 entries per call): in every round the
    aged model is 58 steps further on than the fresh one (60 trained, 2 unpaired warm-up steps), so it walks a
    longer history; the host's speed is the same for both.

    The pairs stop as the tier's do (long_run.aged_vs_fresh_resolved at a 0.5 resolution, here at most 16 pairs
    of 3 rounds) and torch runs one thread. On CI's virtual machine preemption shows in process CPU time, and
    single-step pairs ranged from 0.04 to 40 (CI at d7a8575): the rounds' least CPU time and the log scale of
    the verdict keep the plant apart from the host."""
    real = layer_module.LoRALinear.forward

    def forward(self, x):
        calls = self.__dict__.setdefault("_planted_calls", [])
        calls.extend(range(len(calls), len(calls) + 50))
        for _ in range(200):
            sum(calls)
        return real(self, x)

    monkeypatch.setattr(layer_module.LoRALinear, "forward", forward)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = dataclasses.replace(tiny_cfg, train=dataclasses.replace(tiny_cfg.train, steps=60))
        result, fresh = _aged_and_fresh(cfg)

        crit = dataclasses.replace(
            cfg.criteria, aged_vs_fresh_slowdown_max=0.05, drift_noise_z=3.0, aged_vs_fresh_resolution=0.5
        )
        pairs = run_pairs(
            result.run,
            fresh,
            aged_start=60,
            pairs=8,
            warmup=2,
            max_pairs=16,
            block=8,
            resolved=lambda done: aged_vs_fresh_resolved(done, crit),
            repeats=3,
        )
    finally:
        torch.set_num_threads(threads)
    v = aged_vs_fresh_verdict([p.ratio for p in pairs], slowdown_max=0.05, z=3.0, source="test")
    assert not v.passed, v


class _Steps:
    """A stand-in run whose steps report the CPU times given, in order."""

    def __init__(self, cpu):
        self.cpu, self.steps = list(cpu), []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def step(self, step, record):
        self.steps.append(step)
        return types.SimpleNamespace(cpu_time_s=self.cpu.pop(0), gpu_time_s=None)


def test_a_pair_counts_the_least_cpu_time_of_its_rounds_so_a_preempted_step_drops_out():
    aged = _Steps([0.05, 0.40, 0.05, 0.06, 0.05, 0.70])  # two preempted aged steps
    fresh = _Steps([0.05, 0.05, 0.30, 0.05, 0.05, 0.05])
    pairs = run_pairs(aged, fresh, aged_start=100, pairs=2, warmup=0, repeats=3)
    assert [p.ratio for p in pairs] == [1.0, 1.0] and aged.steps == [100, 101, 102, 103, 104, 105]
    assert [(p.aged_cpu_s, p.aged_span_s) for p in pairs] == [(0.05, None), (0.05, None)]
