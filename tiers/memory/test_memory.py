"""memory tier: TinyLlama-1.1B architecture, batch 1, seq 512, checkpointing: peak VRAM within budget.

With an NF4 base (QLoRA) the same configuration is also run with a 16-bit base, and the report splits
both peaks into weights, quant state, adapters, gradients, optimizer and activations + scratch.
"""

from __future__ import annotations

import pytest

from lora_core.memory import GIB

pytestmark = [pytest.mark.gpu, pytest.mark.memory]


def test_peak_vram_within_budget(tier):
    cfg = tier.config("memory")
    crit = cfg.criteria
    bf16 = None
    if cfg.lora.quantize:
        peak16, split16, _ = tier.run_and_measure(cfg, None, crit.bf16_comparison_steps)
        bf16 = (peak16, split16)
    peak, split, records = tier.run_and_measure(cfg, cfg.lora.quantize)
    tier.record_steps("memory", records)
    tier.record_split(cfg, "memory", peak, split, bf16)
    verdicts = [tier.check.soft("peak allocated VRAM", round(peak / GIB, 3), "<=", crit.vram_budget_gib, unit=" GiB",
                                source="configs/memory.yaml vram_budget_gib")]
    if bf16:
        verdicts.append(tier.check.soft("QLoRA peak < 16-bit-base peak, same configuration", round(peak / GIB, 3), "<",
                                        round(bf16[0] / GIB, 3), unit=" GiB"))
    assert all(v.passed for v in verdicts), [v for v in verdicts if not v.passed]
    tier.check_peak_vs_estimate(peak)
