"""lora_suite.scenarios.aged_vs_fresh on the CPU with the tiny Llama: the pairs' order and steps, and a planted state-growth
defect that the verdict must catch (the unplanted side is replayed from GPU runs in test_long_run.py)."""

from __future__ import annotations

import dataclasses

import pytest

import lora_core.layer as layer_module
from lora_suite.engine.prepare import prepare
from lora_suite.engine.trainer import TrainingRun, train
from lora_suite.measure.criteria import aged_vs_fresh_verdict
from lora_suite.scenarios.aged_vs_fresh import run_pairs


def _aged_and_fresh(cfg):
    aged = prepare(cfg, "cpu")
    result = train(aged.model, aged.batches, cfg.train)
    fresh = prepare(cfg, "cpu")
    return result, TrainingRun(fresh.model, fresh.batches, cfg.train, adapters=fresh.adapters)


def test_pairs_alternate_their_order_and_leave_the_records_alone(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, train=dataclasses.replace(tiny_cfg.train, steps=6, warmup_steps=2))
    result, fresh = _aged_and_fresh(cfg)
    pairs = run_pairs(result.run, fresh, aged_start=6, pairs=4, warmup=2)
    assert [p.aged_first for p in pairs] == [True, False, True, False]
    assert [p.aged_step for p in pairs] == [6, 7, 8, 9] and [p.fresh_step for p in pairs] == [2, 3, 4, 5]
    assert len(result.records) == 6 and fresh.records == []
    assert all(p.aged_cpu_s > 0 and p.fresh_cpu_s > 0 and p.aged_span_s is None for p in pairs)
    assert not result.run.model.training  # the runs leave their models in eval mode, as train() does
    with pytest.raises(ValueError, match="pairs >= 2, warmup >= 0, max_pairs >= pairs and block >= 2, got pairs=1"):
        run_pairs(result.run, fresh, aged_start=6, pairs=1, warmup=0)


def test_more_pairs_are_run_until_resolved_or_the_cap(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, train=dataclasses.replace(tiny_cfg.train, steps=4, warmup_steps=2))
    result, fresh = _aged_and_fresh(cfg)
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
    """Every LoRA layer walks a history of its own calls on each forward: the aged model (60 steps) walks a long
    one, the fresh model a short one; the host's speed is the same for both."""
    real = layer_module.LoRALinear.forward

    def forward(self, x):
        calls = self.__dict__.setdefault("_planted_calls", [])
        calls.append(len(calls))
        for _ in range(2000):
            sum(calls)
        return real(self, x)

    monkeypatch.setattr(layer_module.LoRALinear, "forward", forward)
    cfg = dataclasses.replace(tiny_cfg, train=dataclasses.replace(tiny_cfg.train, steps=60))
    result, fresh = _aged_and_fresh(cfg)
    pairs = run_pairs(result.run, fresh, aged_start=60, pairs=12, warmup=2)
    v = aged_vs_fresh_verdict([p.ratio for p in pairs], slowdown_max=0.05, z=3.0, source="test")
    assert not v.passed, v
