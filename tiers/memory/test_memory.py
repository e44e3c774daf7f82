"""memory tier: TinyLlama-1.1B architecture, batch 1, seq 512, checkpointing: peak VRAM within budget."""

from __future__ import annotations

import pytest
import torch

from lora_core.memory import GIB
from lora_core.trainer import train

pytestmark = [pytest.mark.gpu, pytest.mark.memory]


def test_peak_vram_within_budget(tier):
    cfg = tier.config("memory")
    torch.cuda.reset_peak_memory_stats()
    prepared = tier.prepare(cfg)
    after_build = torch.cuda.memory_allocated()
    result = train(prepared.model, prepared.batches, cfg.train, tokens_per_batch=prepared.batches.tokens_per_batch)
    peak = torch.cuda.max_memory_allocated()
    tier.record_steps("memory", result.records)
    tier.check_backend(prepared.model, cfg.backend)
    tier.report.notes.append(f"{tier.nodeid}: allocated after build {after_build / GIB:.3f} GiB, peak "
                             f"{peak / GIB:.3f} GiB, reserved peak {torch.cuda.max_memory_reserved() / GIB:.3f} GiB")
    tier.check("peak allocated VRAM", round(peak / GIB, 3), "<=", cfg.criteria.vram_budget_gib, unit=" GiB",
               source="configs/memory.yaml vram_budget_gib")
    tier.check_peak_vs_estimate(peak)
