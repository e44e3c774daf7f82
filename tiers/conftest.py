"""Fixtures shared by the tiers: config loading with CLI overrides, the VRAM pre-check, model set-up,
and recording per-step series (with plots) in the run report."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from lora_core.config import CONFIG_DIR, TierConfig, load_tier_config
from lora_core.data import Batches, tokenizer_for
from lora_core.inject import lora_modules
from lora_core.memory import GIB, estimate_training_memory, nvml_memory, vram_verdict
from lora_core.models import CheckpointNotFound
from lora_core.recipe import Prepared, prepare
from lora_core.report import Series
from lora_core.trainer import StepRecord


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
        cols = tuple(f.name for f in dataclasses.fields(StepRecord))
        rows = tuple(tuple(getattr(r, c) for c in cols) for r in records)
        self.report.add_series(Series(self.nodeid, f"{name}: loss", cols, rows,
                                      plot_x="step" if plots else None, plot_y=("loss",)))
        if plots:
            mem_cols = ("step", "allocated_mib", "reserved_mib", "nvml_used_mib")
            mem_rows = tuple((r.step, r.allocated_mib, r.reserved_mib, r.nvml_used_mib or 0.0) for r in records)
            self.report.add_series(Series(self.nodeid, f"{name}: memory (MiB)", mem_cols, mem_rows,
                                          plot_x="step", plot_y=mem_cols[1:]))

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


def gib(x: float) -> float:
    return round(x / GIB, 3)
