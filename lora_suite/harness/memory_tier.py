"""The memory tier's own behaviour on a ``Tier`` (``lora_suite.harness.tier``): one run's own peak of allocated
GPU memory, its split into parts against the estimate, and the memory verdicts. The full tier runs the same
measurement around its long run.

- The peak is net of what earlier work left allocated (``lora_suite.measure.memory.PeakWindow``).
- An NF4 tier (QLoRA) also runs the same configuration on a 16-bit base (``bf16_baseline``): its peak must be lower.
- The split (weights, quant state, adapters, gradients, optimizer, activations + scratch) is recorded beside the
  estimate of each part (``lora_suite.measure.memory.estimate_tier``), and the estimate of the peak is judged:
  |estimate − measured| / measured ≤ the YAML's ``memory_estimate_error_max``, on both sides."""

from __future__ import annotations

import gc

import torch

from lora_suite.engine.step_record import StepRecord
from lora_suite.harness.figures import record_figure
from lora_suite.harness.report import Series
from lora_suite.harness.tier import Tier
from lora_suite.measure.carried import carried_note
from lora_suite.measure.memory import GIB, PeakWindow, measured_split
from lora_suite.settings.config import TierConfig

# (peak allocated bytes, its split by part in bytes) of one run
PeakSplit = tuple[int, dict[str, int]]


class MemoryTier:
    """The memory tier's measurement and verdicts, on the session's ``tier``: ``MemoryTier(tier)`` in the test."""

    def __init__(self, tier: Tier):
        self.tier = tier

    def peak_window(self, name: str) -> PeakWindow:
        """Open a measurement of one run's own peak (``lora_suite.measure.memory.PeakWindow``) and note what it excludes."""
        window = PeakWindow.open()
        self.tier.report.notes.append(
            f"{self.tier.nodeid}: {name}: peak measured net of {window.carried / 2**20:.1f} MiB left "
            f"allocated by earlier work ({window.released / 2**20:.1f} MiB of cached cuBLAS "
            f"workspaces released first){carried_note(window.carried)}"
        )
        return window

    def run_and_measure(
        self, cfg: TierConfig, quantize: str | None, steps: int | None = None, **train_kw
    ) -> tuple[int, dict[str, int], list[StepRecord]]:
        """Train ``steps`` (default: all) with the given base storage, ``train_kw`` passed on to ``Tier.train`` (a
        ``device_timer``); return (this run's peak bytes, split, records)."""
        tier = self.tier
        name = f"{cfg.tier} ({quantize or cfg.dtype} base)"
        window = self.peak_window(name)
        prepared = tier.prepare(cfg, quantize=quantize)
        result = tier.train(name, prepared, cfg, stop_step=steps, **train_kw)
        peak = window.peak()
        tier.note_process_memory(result)
        tier.check_served(prepared)
        split = measured_split(prepared.model, result.optimizer, peak, prepared.adapters)
        del prepared, result.optimizer
        gc.collect()
        torch.cuda.empty_cache()
        return peak, split, result.records

    def record_split(
        self, cfg: TierConfig, name: str, peak: int, split: dict[str, int], bf16: PeakSplit | None = None
    ) -> None:
        """The measured split of the peak beside the estimate of each part and, for an NF4 tier, the 16-bit base's."""
        est = self.tier.estimate.gib()
        est["activations_and_scratch"] = round(est["activations"] + est["logits"] + est["dequant_scratch"], 3)
        rows = []
        for part, value in split.items():
            rows.append((part, round(value / GIB, 4), est[part], round(bf16[1][part] / GIB, 4) if bf16 else None))
        rows.append(
            ("peak allocated", round(peak / GIB, 4), est["allocated_peak"], round(bf16[0] / GIB, 4) if bf16 else None)
        )
        self.tier.report.add_series(
            Series(
                self.tier.nodeid,
                f"{name}: memory split (GiB)",
                ("part", f"measured ({cfg.lora.quantize or cfg.dtype} base)", "estimated", "measured, 16-bit base"),
                tuple(rows),
            )
        )

    def bf16_baseline(self, cfg: TierConfig) -> PeakSplit | None:
        """For an NF4 tier: (peak, split) of the same configuration on a 16-bit base; None otherwise."""
        if not cfg.lora.quantize:
            return None
        no_16bit = self.tier.impl.reason_not_applicable("bf16_base")
        if no_16bit:  # e.g. peft-bnb: its base is always bitsandbytes NF4
            self.tier.check.not_applicable("QLoRA peak < 16-bit-base peak (same configuration)", no_16bit)
            return None
        peak, split, _ = self.run_and_measure(cfg, None, cfg.criteria.bf16_comparison_steps)
        return peak, split

    def check_memory(self, cfg: TierConfig, peak: int, bf16: PeakSplit | None) -> None:
        """Peak within the budget of the base actually used, and (NF4) below the 16-bit-base peak."""
        tier, crit, yaml = self.tier, cfg.criteria, f"configs/{cfg.tier}.yaml"
        record_figure(tier.report, tier.nodeid, cfg.tier, "peak GPU memory", peak / 2**30, missing_ok=True)
        nf4_skipped = tier.configured_quantize and not cfg.lora.quantize
        budget, key = (
            (crit.vram_budget_16bit_base_gib, "vram_budget_16bit_base_gib")
            if nf4_skipped
            else (crit.vram_budget_gib, "vram_budget_gib")
        )
        if budget is None:
            tier.check.not_applicable(
                "peak allocated VRAM within budget",
                f"{yaml} sets no {key} for the {'16-bit' if nf4_skipped else cfg.dtype} base this run used",
            )
        else:
            tier.check(
                "peak allocated VRAM",
                round(peak / GIB, 3),
                "<=",
                budget,
                unit=" GiB",
                source=f"{yaml} {key}; this process's torch allocator peak (no other process's memory is in it)",
            )
        name = "QLoRA peak < 16-bit-base peak (same configuration)"
        if bf16:
            steps = crit.bf16_comparison_steps or cfg.train.steps
            tier.check(f"{name[:-1]}, {steps} steps)", round(peak / GIB, 3), "<", round(bf16[0] / GIB, 3), unit=" GiB")
        elif nf4_skipped:
            tier.check.not_applicable(name, str(tier.impl.reason_not_applicable("nf4_base")))

    def check_peak_vs_estimate(self, cfg: TierConfig, peak_bytes: int) -> None:
        """|estimate − measured| / measured peak within the YAML's memory_estimate_error_max, both sides."""
        tier, bar = self.tier, cfg.criteria.memory_estimate_error_max
        if bar is None:
            return
        est = tier.estimate.allocated_peak
        err = (est - peak_bytes) / peak_bytes
        tier.report.notes.append(f"{tier.nodeid}: memory estimate {tier.estimate.gib()} GiB")
        source = (
            f"configs/{cfg.tier}.yaml memory_estimate_error_max (the estimator must be this close for --check-vram)"
        )
        tier.check("estimated vs measured peak allocated, relative error", round(err, 3), "<=", bar, source=source)
        tier.check(
            "estimated vs measured peak allocated, relative error (underestimate side)",
            round(err, 3),
            ">=",
            -bar,
            source=source,
        )
