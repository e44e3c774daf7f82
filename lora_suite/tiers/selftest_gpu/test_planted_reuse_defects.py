"""selftest-gpu, the reuse of a checkpointed recompute's NF4 bases (``lora_core.ops.recompute``): each test plants
one defect in ``recompute.take`` (a monkeypatch here, never in shipped code) and asserts that the criterion written
for it fails:

- a kept base the backward never takes (it dequantises again, and the kept copies are dropped): the memory and full
  tiers' reuse check (``lora_suite.harness.recompute_reuse``) must fail;
- the kept base of *another* weight of the same shape taken (a wrong key): the convergence tier's bitwise test
  (``tiers/convergence/test_nf4_recompute_reuse.py``) must fail.
"""

from __future__ import annotations

import operator
from pathlib import Path

import pytest
import torch

from lora_suite.harness.modules import load_test_module

pytestmark = [pytest.mark.gpu, pytest.mark.selftest_gpu, pytest.mark.needs_feature("lora_core_ops")]
REUSE_TEST = Path(__file__).resolve().parents[1] / "convergence" / "test_nf4_recompute_reuse.py"
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")


class _Recorder:
    """A checker that records each verdict instead of failing the test (the plant's criterion is meant to fail)."""

    OPS = {">": operator.gt, "==": operator.eq}

    def __init__(self):
        self.rows: list[tuple[str, object, bool]] = []

    def __call__(self, name, value, op, threshold, **_):
        self.rows.append((name, value, self.OPS[op](value, threshold)))

    def failed(self) -> list[str]:
        return [f"{name}: {value}" for name, value, ok in self.rows if not ok]


def test_a_kept_base_never_taken_fails_the_tiers_reuse_check(tier, tiny_cupy_llama, monkeypatch):
    from lora_core.ops import recompute
    from lora_suite.engine.trainer import train
    from lora_suite.harness import recompute_reuse
    from lora_suite.settings.config import TrainSettings

    monkeypatch.setattr(recompute, "take", lambda nf4, role, dtype: None)
    model = tiny_cupy_llama(targets=QKVO, quantize="nf4")
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(5)).to("cuda")
    settings = TrainSettings(steps=3, lr=1e-3, warmup_steps=1, gradient_checkpointing=True, log_every=3)
    recorder = _Recorder()
    before = recompute_reuse.counts()
    train(model, lambda i: {"input_ids": ids, "labels": ids}, settings)
    recompute_reuse.check(recorder, "planted", before)
    failed = recorder.failed()
    tier.check(
        "planted kept base never taken: the tiers' reuse check rows failing",
        len(failed),
        ">",
        0,
        source="lora_suite.harness.recompute_reuse.check",
        detail="; ".join(failed),
    )


def test_the_base_of_another_weight_taken_fails_the_bitwise_reuse_test(tier, tiny_cupy_llama, monkeypatch):
    from lora_core.ops import recompute

    real_take = recompute.take

    def planted(nf4, role, dtype):
        """Another weight's kept base of the same shape where one is held (q_proj's for o_proj: both 256x256)."""
        with recompute._lock:
            for key, (_, w, codes) in list(recompute._kept.items()):
                if codes is not nf4.packed and tuple(w.shape) == tuple(nf4.shape) and w.dtype == dtype:
                    del recompute._kept[key]
                    recompute._counts["taken"] += 1
                    return w
        return real_take(nf4, role, dtype)

    monkeypatch.setattr(recompute, "take", planted)
    reuse = load_test_module(REUSE_TEST, "recompute_reuse_plant")
    try:
        reuse.test_checkpointed_nf4_training_reuses_the_recomputed_bases_bitwise_alike(
            tiny_cupy_llama, "qkvo-frozen-nf4-mlp"
        )
        caught = ""
    except AssertionError as exc:
        caught = str(exc).splitlines()[0][:300]
    tier.check(
        "planted wrong base taken: the convergence tier's bitwise reuse test fails",
        bool(caught),
        "==",
        True,
        source="tiers/convergence/test_nf4_recompute_reuse.py",
        detail=caught,
    )
