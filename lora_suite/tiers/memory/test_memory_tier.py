"""memory tier: TinyLlama-1.1B architecture, batch 1, seq 512, checkpointing: peak VRAM within budget.

With an NF4 base (QLoRA) the same configuration is also run with a 16-bit base, and the report splits
both peaks into weights, quant state, adapters, gradients, optimizer and activations + scratch.
"""

from __future__ import annotations

import pytest

from lora_suite.harness.memory_tier import MemoryTier

pytestmark = [pytest.mark.gpu, pytest.mark.memory]


def test_peak_vram_within_budget(tier):
    cfg = tier.config("memory")
    memory = MemoryTier(tier)
    bf16 = memory.bf16_baseline(cfg)
    peak, split, _ = memory.run_and_measure(cfg, cfg.lora.quantize)
    memory.record_split(cfg, "memory", peak, split, bf16)
    memory.check_memory(cfg, peak, bf16)
    memory.check_peak_vs_estimate(cfg, peak)
