"""quick tier: whole-model gradients at step 0 against an fp32 copy of the model (lora_suite/engine/gradients.py).

Three runs on the same batch and adapters, each judged per adapter against the fp32 reference with the
16-bit torch reference's own error as the yardstick: the implementation under test, the trainer's gradient
accumulation over k micro-batches, and activation checkpointing. The reference is the same base model with
the same adapter values on lora_core's torch reference backend, whatever the implementation under test.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lora_suite.engine import gradients as G
from lora_suite.harness.gradient_verdicts import against_reference, judge_gradients

pytestmark = [pytest.mark.gpu, pytest.mark.quick, pytest.mark.model_code]


def test_whole_model_gradients_match_the_fp32_reference(tier):
    cfg = tier.config("quick")
    crit = cfg.criteria
    prepared = tier.prepare(cfg)
    G.randomize_lora_b(prepared.model, std=0.02, seed=cfg.train.seed, adapters=prepared.adapters)
    reference = tier.prepare(cfg, implementation="torch")  # same seed: the same base weights
    G.copy_adapters(reference.adapters, {n: p.detach() for n, p in prepared.adapters.items()})
    batch = prepared.batches(0)
    assert not torch.backends.cuda.matmul.allow_tf32, "the fp32 reference must not run in TF32"
    results = against_reference(prepared, reference, batch, tier.impl.name, crit)
    tier.check_served(prepared)
    judge_gradients(tier, results, crit, "quick")


@pytest.mark.needs_feature("lora_core_ops")
def test_fused_model_gradients_match_the_fp32_reference(tier):
    """The quick tier's whole-model gradient check (SmolLM2-135M, step 0) with every linear adapted and the MLP and
    QKV fused: the same judge, factor and reference as the test above."""
    cfg = tier.config("quick")
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, targets=("all-linear",)))
    crit = cfg.criteria
    prepared = tier.prepare(cfg, implementation="cupy-fused")
    G.randomize_lora_b(prepared.model, std=0.02, seed=cfg.train.seed, adapters=prepared.adapters)
    reference = tier.prepare(cfg, implementation="torch")
    G.copy_adapters(reference.adapters, {n: p.detach() for n, p in prepared.adapters.items()})
    results = against_reference(prepared, reference, prepared.batches(0), "cupy-fused", crit)
    tier.check(
        "code path that served every LoRA layer (cupy-fused)",
        prepared.implementation.served_by(prepared.model),
        "==",
        "cupy-fused",
    )
    for res in results:
        tier.check(
            f"{res.label}: adapters beyond tolerance (of {len(res.rows)})",
            res.n_bad,
            "==",
            0,
            source="err <= grad_match_factor * max(err_16bit_ref, median): configs/quick.yaml",
            detail=G.describe_failures(res.rows),
        )
