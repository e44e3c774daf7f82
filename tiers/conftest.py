"""Fixtures shared by the tiers: config loading with CLI overrides, the VRAM pre-check, model set-up,
and recording per-step series (with plots) in the run report."""

from __future__ import annotations

import dataclasses
import gc
import time

import pytest
import torch

from lora_suite.config import CONFIG_DIR, TierConfig, load_tier_config
from lora_suite.data import Batches, tokenizer_for
from lora_core.inject import lora_modules
from lora_suite.memory import GIB, estimate_training_memory, measured_split, nvml_memory, vram_verdict
from lora_suite.models import CheckpointNotFound
from lora_suite.recipe import Prepared, prepare
from lora_suite.report import Series
from lora_suite.trainer import StepRecord, TrainResult, train


class Tier:
    """What a tier test needs from the session: its config, a prepared model, and the report."""

    def __init__(self, request, run_report, check):
        self.request, self.report, self.check = request, run_report, check
        self.nodeid = request.node.nodeid

    def config(self, tier: str) -> TierConfig:
        cfg = load_tier_config(CONFIG_DIR / f"{tier}.yaml")
        weights = self.request.config.getoption("weights")
        backend = self.request.config.getoption("backend")
        cfg = dataclasses.replace(cfg, weights=weights or cfg.weights, backend=backend or cfg.backend or "cupy")
        self._vram_precheck(cfg)
        return cfg

    def _vram_precheck(self, cfg: TierConfig) -> None:
        est = estimate_training_memory(cfg.model.architecture, cfg.lora, batch_size=cfg.data.batch_size,
                                       seq_len=cfg.data.seq_len,
                                       gradient_checkpointing=cfg.train.gradient_checkpointing, dtype=cfg.dtype)
        self.estimate = est
        if not self.request.config.getoption("check_vram"):
            return
        mem = nvml_memory()
        if mem is None:
            pytest.skip("--check-vram: NVML gives no reading for this device")
        ok, msg = vram_verdict(est, mem.free)
        self.report.notes.append(f"{self.nodeid}: {msg}")
        if not ok:
            if self.request.config.getoption("strict_vram"):
                pytest.fail(msg + " (--strict-vram)")
            pytest.skip(msg)

    def prepare(self, cfg: TierConfig, **kw) -> Prepared:
        try:
            prepared = prepare(cfg, "cuda", **kw)
        except CheckpointNotFound as exc:
            pytest.skip(str(exc))
        self.report.notes.append(f"{self.nodeid}: {prepared.describe(cfg)} (built in {prepared.built.build_seconds:.1f} s)")
        return prepared

    def batches_for(self, cfg: TierConfig, built) -> Batches:
        return Batches(cfg.data, tokenizer_for(built.tokenizer), cfg.model.architecture.vocab_size, "cuda")

    def check_backend(self, model, expected: str) -> None:
        used = {m.last_backend for m in lora_modules(model).values()}
        self.check("backend that served every LoRA layer", ",".join(sorted(map(str, used))), "==", expected,
                   source="--backend (default cupy); no silent fallback")

    def record_steps(self, name: str, records: list[StepRecord], plots: bool = True) -> None:
        if not records:
            return
        cols = tuple(f.name for f in dataclasses.fields(StepRecord))
        rows = tuple(tuple(getattr(r, c) for c in cols) for r in records)
        self.report.add_series(Series(self.nodeid, f"{name}: loss", cols, rows,
                                      plot_x="step" if plots else None, plot_y=("loss",)))
        if plots:
            mem_cols = ("step", "allocated_mib", "reserved_mib", "nvml_used_mib")
            mem_rows = tuple((r.step, r.allocated_mib, r.reserved_mib, r.nvml_used_mib or 0.0) for r in records)
            self.report.add_series(Series(self.nodeid, f"{name}: memory (MiB)", mem_cols, mem_rows,
                                          plot_x="step", plot_y=mem_cols[1:]))

    def train(self, name: str, prepared: Prepared, cfg: TierConfig, *, plots: bool = True, **kw) -> TrainResult:
        """Train and record the per-step series, also when training stops early (NaN, an error, Ctrl-C)."""
        records: list[StepRecord] = []
        try:
            return train(prepared.model, prepared.batches, cfg.train, records=records, **kw)
        except BaseException as exc:
            self.report.notes.append(f"{self.nodeid}: {name} stopped after {len(records)} recorded steps: "
                                     f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self.record_steps(name, records, plots=plots)

    def run_and_measure(self, cfg, quantize, steps=None):
        """Train ``steps`` (default: all) with the given base storage; return (peak bytes, split, records)."""
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        prepared = self.prepare(cfg, quantize=quantize)
        result = self.train(f"{cfg.tier} ({quantize or cfg.dtype} base)", prepared, cfg, stop_step=steps)
        peak = torch.cuda.max_memory_allocated()
        self.check_backend(prepared.model, cfg.backend)
        split = measured_split(prepared.model, result.optimizer, peak)
        del prepared, result.optimizer
        gc.collect()
        torch.cuda.empty_cache()
        return peak, split, result.records

    def record_split(self, cfg, name, peak, split, bf16=None):
        est = self.estimate.gib()
        est["activations_and_scratch"] = round(est["activations"] + est["logits"] + est["dequant_scratch"], 3)
        rows = []
        for part, value in split.items():
            rows.append((part, round(value / GIB, 4), est[part], round(bf16[1][part] / GIB, 4) if bf16 else None))
        rows.append(("peak allocated", round(peak / GIB, 4), est["allocated_peak"], round(bf16[0] / GIB, 4) if bf16 else None))
        self.report.add_series(Series(self.nodeid, f"{name}: memory split (GiB)",
                                      ("part", f"measured ({cfg.lora.quantize or cfg.dtype} base)", "estimated",
                                       "measured, 16-bit base"), tuple(rows)))

    def bf16_baseline(self, cfg: TierConfig):
        """For an NF4 tier: (peak, split) of the same configuration on a 16-bit base; None otherwise."""
        if not cfg.lora.quantize:
            return None
        peak, split, _ = self.run_and_measure(cfg, None, cfg.criteria.bf16_comparison_steps)
        return peak, split

    def memory_verdicts(self, cfg: TierConfig, peak: int, bf16) -> list:
        """Recorded (not yet asserted) checks: peak within the budget, and below the 16-bit baseline."""
        verdicts = [self.check.soft("peak allocated VRAM", round(peak / GIB, 3), "<=", cfg.criteria.vram_budget_gib,
                                    unit=" GiB", source=f"configs/{cfg.tier}.yaml vram_budget_gib")]
        if bf16:
            steps = cfg.criteria.bf16_comparison_steps or cfg.train.steps
            verdicts.append(self.check.soft(f"QLoRA peak < 16-bit-base peak (same configuration, {steps} steps)",
                                            round(peak / GIB, 3), "<", round(bf16[0] / GIB, 3), unit=" GiB"))
        return verdicts

    @staticmethod
    def assert_all(verdicts) -> None:
        __tracebackhide__ = True
        failed = [f"{v.name}: {v.value} not {v.op} {v.threshold}{(' (' + v.detail + ')') if v.detail else ''}"
                  for v in verdicts if not v.passed]
        assert not failed, "; ".join(failed)

    def check_peak_vs_estimate(self, peak_bytes: int) -> None:
        est = self.estimate.allocated_peak
        err = (est - peak_bytes) / peak_bytes * 100
        self.report.notes.append(f"{self.nodeid}: memory estimate {self.estimate.gib()} GiB")
        self.check("estimated vs measured peak allocated, error", round(err, 1), "<=", 30.0, unit=" %",
                   source="|error| <= 30%: the estimator must be this close to be useful to --check-vram")
        self.check("estimated vs measured peak allocated, error (underestimate side)", round(err, 1), ">=", -30.0,
                   unit=" %", source="same")


@pytest.fixture
def tier(request, run_report, check) -> Tier:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: none found (torch.cuda.is_available() is False)")
    torch.cuda.init()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    t = Tier(request, run_report, check)
    yield t
    run_report.notes.append(f"{request.node.nodeid}: wall time {time.perf_counter() - start:.1f} s")

