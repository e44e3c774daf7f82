"""full tier: Llama-2-7B architecture, 1000 steps: VRAM budget, loss falls, adapter checkpoint round trip."""

from __future__ import annotations

import gc

import pytest
import torch

from lora_core.checkpoint import load_adapter_checkpoint, save_adapter_checkpoint
from lora_core.criteria import loss_drop
from lora_core.memory import GIB
from lora_core.trainer import train

pytestmark = [pytest.mark.gpu, pytest.mark.full]


def test_llama7b_end_to_end(tier, tmp_path):
    cfg = tier.config("full")
    crit = cfg.criteria
    torch.cuda.reset_peak_memory_stats()
    prepared = tier.prepare(cfg)
    result = train(prepared.model, prepared.batches, cfg.train, tokens_per_batch=prepared.batches.tokens_per_batch)
    peak = torch.cuda.max_memory_allocated()
    tier.record_steps("full", result.records)
    tier.check_backend(prepared.model, cfg.backend)
    tier.check("peak allocated VRAM", round(peak / GIB, 3), "<=", crit.vram_budget_gib, unit=" GiB",
               source="configs/full.yaml vram_budget_gib")
    tier.check_peak_vs_estimate(peak)
    drop = loss_drop(result.losses, crit.loss_window)
    tier.check(f"loss drop, mean of first {crit.loss_window} vs last {crit.loss_window} steps", round(drop, 4), ">=",
               crit.loss_drop_min, source="configs/full.yaml loss_drop_min")
    if not crit.checkpoint_roundtrip:
        return
    probe = prepared.batches(10_000)["input_ids"]
    with torch.no_grad():
        logits = prepared.model(input_ids=probe).logits.float().cpu()
    ckpt = save_adapter_checkpoint(prepared.model, tmp_path / "adapters", step=cfg.train.steps,
                                   optimizer=result.optimizer)
    del prepared, result
    gc.collect()
    torch.cuda.empty_cache()
    fresh = tier.prepare(cfg)  # same seed: the same base weights, adapters freshly initialised
    step = load_adapter_checkpoint(fresh.model, ckpt)
    with torch.no_grad():
        reloaded = fresh.model(input_ids=probe).logits.float().cpu()
    tier.check("checkpoint step", step, "==", cfg.train.steps)
    tier.check("max |logits(trained) - logits(reloaded)|", float((logits - reloaded).abs().max()), "==", 0.0,
               source="same weights, same kernels: bit-identical logits")
