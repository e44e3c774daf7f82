"""The ``Tier`` a tier test works through: what every tier shares (its config with the command line's overrides,
the VRAM pre-check, model set-up with the LoRA implementation under test, the checks that ask that implementation
which path served the layers and what it cannot do, memory verdicts, per-step series with plots in the run report).

A tier is read in three files: its test (tiers/<tier>/test_<tier>_tier.py), its YAML (configs/<tier>.yaml, every
threshold, and its ``suite:`` entry in the tier registry) and this file."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from lora_suite.engine.models import CheckpointNotFound
from lora_suite.engine.prepare import Prepared, fit_to_implementation, prepare
from lora_suite.engine.trainer import StepRecord, TrainingRun, TrainResult, train
from lora_suite.harness import recompute_reuse
from lora_suite.harness.figures import record_figure
from lora_suite.harness.oom_retry import record_retry, retried_config
from lora_suite.harness.report import Series
from lora_suite.measure.carried import carried_note
from lora_suite.measure.device_time import DeviceTimer, DeviceWindow
from lora_suite.measure.device_time import window as device_window
from lora_suite.measure.memory import GIB, PeakWindow, estimate_tier, measured_split, vram_verdict
from lora_suite.measure.nvml import nvml_memory
from lora_suite.measure.vram_limit import limited_free
from lora_suite.scenarios.aged_vs_fresh import Pair, run_pairs
from lora_suite.scenarios.long_run import LongRunVerdicts, aged_vs_fresh_resolved, time_budget_rows
from lora_suite.settings.config import CONFIG_DIR, TierConfig
from lora_suite.settings.loader import load_tier_config


class Tier:
    """What a tier test needs from the session: its config, a prepared model, and the report."""

    def __init__(self, request, run_report, check, impl):
        self.request, self.report, self.check, self.impl = request, run_report, check, impl
        self.nodeid = request.node.nodeid
        self.configured_quantize: str | None = None  # the YAML's base storage, before the implementation's limits
        self.oom_retries: list[str] = []  # --oom-retry: where each earlier attempt ran out of memory

    def config(self, tier: str) -> TierConfig:
        """The tier's YAML with --weights and the implementation under test applied.

        What the implementation declares it cannot do is changed as ``engine.prepare.fit_to_implementation`` says (an
        NF4 base becomes 16-bit for ``nf4_base``, a 16-bit one NF4 for ``bf16_base``, fp32 adapters on a 16-bit base
        take the base's dtype, rsLoRA and captured steps are dropped), each change recorded as not applicable with the
        implementation's reason; the checks only an NF4 base can take are recorded as not applicable by the tier.
        """
        cfg = load_tier_config(CONFIG_DIR / f"{tier}.yaml")
        weights = self.request.config.getoption("weights")
        if self.request.config.getoption("lora_impl") is None and cfg.implementation != self.impl.name:
            pytest.fail(
                f"configs/{tier}.yaml implementation: {cfg.implementation!r}, but this run judges "
                f"{self.impl.name!r}: give --lora-impl {cfg.implementation} to run that tier"
            )
        cfg = dataclasses.replace(cfg, weights=weights or cfg.weights, implementation=self.impl.name)
        self.configured_quantize = cfg.lora.quantize
        cfg, changes = fit_to_implementation(cfg, self.impl, f"configs/{tier}.yaml")
        recorded = {(n.name, n.reason) for n in self.report.not_applicable}
        for what, reason in changes:  # a tier-wide change is one record, not one per test that reads the tier
            if (what, reason) not in recorded:
                self.check.not_applicable(what, reason)
        if self.request.config.getoption("fused_ops", None) and cfg.train.cuda_graph and not self.impl.fuses_loss:
            from lora_suite.implementations.liger_ops import LCE_LEFT_OUT

            self.check.not_applicable("--fused-ops liger: fused linear cross-entropy", LCE_LEFT_OUT)
        if self.oom_retries:  # --oom-retry: run again with the micro-batch halved (harness/oom_retry.py)
            configured, cfg = cfg, retried_config(cfg, len(self.oom_retries))
            record_retry(self, cfg, configured)
        self._vram_precheck(cfg)
        return cfg

    def _vram_precheck(self, cfg: TierConfig) -> None:
        self.estimate_cfg = cfg  # what an out-of-memory verdict estimates other settings from (measure/oom.py)
        self.estimate = est = estimate_tier(cfg)
        if not self.request.config.getoption("check_vram"):
            return
        mem = nvml_memory()
        if mem is None:
            pytest.skip("--check-vram: NVML gives no reading for this device")
        limit = float(self.request.config.getoption("vram_limit", None) or 0) or None  # --vram-limit: the card's
        ok, msg = vram_verdict(est, limited_free(mem.free, limit, torch.cuda.memory_reserved()), mem.used, limit)
        self.report.notes.append(f"{self.nodeid}: {msg}")
        if not ok:
            if self.request.config.getoption("strict_vram"):
                pytest.fail(msg + " (--strict-vram)")
            pytest.skip(msg)

    def prepare(self, cfg: TierConfig, *, implementation=None, **kw) -> Prepared:
        """The model with adapters from ``implementation`` (default: the one under test). On an NF4 base a
        comparison run gets the quantised weights of the implementation under test (``base_from``): a reference
        judges the LoRA layer, not two quantisers' absmax rounding."""
        kw.setdefault("base_from", self.impl)
        try:
            prepared = prepare(cfg, "cuda", implementation=implementation or self.impl, **kw)
        except CheckpointNotFound as exc:
            pytest.skip(str(exc))
        fused_ops = self.request.config.getoption("fused_ops", None)
        ops = ""
        if fused_ops and prepared.implementation is self.impl:  # the stack under test only: references stay plain
            from lora_suite.implementations.liger_ops import apply_liger_ops, describe_liger

            apply_liger_ops(prepared.model, captured=cfg.train.cuda_graph)
            ops = f"; --fused-ops {fused_ops}: {describe_liger(prepared.model)}"
        self.report.notes.append(
            f"{self.nodeid}: {prepared.describe(cfg)} (built in {prepared.built.build_seconds:.1f} s){ops}"
        )
        return prepared

    def check_served(self, prepared: Prepared) -> None:
        """The code path that served every adapted layer is the one under test (no silent fallback)."""
        impl = prepared.implementation
        self.check(
            f"code path that served every LoRA layer ({impl.name})",
            impl.served_by(prepared.model),
            "==",
            impl.expected_path,
            source="--lora-impl (default cupy): the implementation says which path ran",
        )

    def record_steps(self, name: str, records: list[StepRecord], plots: bool = True) -> None:
        if not records:
            return
        cols = tuple(f.name for f in dataclasses.fields(StepRecord))
        rows = tuple(tuple(getattr(r, c) for c in cols) for r in records)
        self.report.add_series(
            Series(self.nodeid, f"{name}: loss", cols, rows, plot_x="step" if plots else None, plot_y=("loss",))
        )
        if plots:
            mem_cols = ("step", "allocated_mib", "reserved_mib", "process_gpu_mib", "nvml_used_mib")
            mem_rows = tuple(
                (r.step, r.allocated_mib, r.reserved_mib, r.process_gpu_mib or 0.0, r.nvml_used_mib or 0.0)
                for r in records
            )
            self.report.add_series(
                Series(self.nodeid, f"{name}: memory (MiB)", mem_cols, mem_rows, plot_x="step", plot_y=mem_cols[1:])
            )

    def train(self, name: str, prepared: Prepared, cfg: TierConfig, *, plots: bool = True, **kw) -> TrainResult:
        """Train and record the per-step series, also when training stops early (NaN, an error, Ctrl-C)."""
        records: list[StepRecord] = []
        try:
            with recompute_reuse.checked(self.check, name, prepared, cfg):  # lora_core, NF4, checkpointing
                return train(
                    prepared.model,
                    prepared.batches,
                    cfg.train,
                    records=records,
                    adapters=kw.pop("adapters", prepared.adapters),
                    **kw,
                )
        except BaseException as exc:
            self.report.notes.append(
                f"{self.nodeid}: {name} stopped after {len(records)} recorded steps: {type(exc).__name__}: {exc}"
            )
            raise
        finally:
            self.record_steps(name, records, plots=plots)

    def aged_vs_fresh(self, cfg: TierConfig, aged: TrainResult, **kw) -> list[Pair]:
        """After a run: a fresh run from the same config and seed takes turns with it (lora_suite.scenarios.aged_vs_fresh);
        ``kw`` (a step_hook) goes to the fresh run as it went to the aged one. The pairs are recorded as a series."""
        crit = cfg.criteria
        fresh = self.prepare(cfg)
        fresh_run = TrainingRun(fresh.model, fresh.batches, cfg.train, adapters=fresh.adapters, **kw)
        pairs = run_pairs(
            aged.run,
            fresh_run,
            aged_start=cfg.train.steps,
            pairs=crit.aged_vs_fresh_pairs,
            warmup=crit.aged_vs_fresh_warmup,
            max_pairs=crit.aged_vs_fresh_pairs_max,
            resolved=lambda done: aged_vs_fresh_resolved(done, crit),
            repeats=crit.aged_vs_fresh_repeats,
        )
        self.report.add_series(
            Series(
                self.nodeid,
                "aged vs fresh: alternating pairs (process CPU ms, event span ms)",
                (
                    "pair",
                    "aged step",
                    "fresh step",
                    "aged first",
                    "aged CPU ms",
                    "fresh CPU ms",
                    "ratio",
                    "aged span ms",
                    "fresh span ms",
                ),
                tuple(
                    (
                        p.index,
                        p.aged_step,
                        p.fresh_step,
                        p.aged_first,
                        round(p.aged_cpu_s * 1e3, 3),
                        round(p.fresh_cpu_s * 1e3, 3),
                        round(p.ratio, 4),
                        None if p.aged_span_s is None else round(p.aged_span_s * 1e3, 3),
                        None if p.fresh_span_s is None else round(p.fresh_span_s * 1e3, 3),
                    )
                    for p in pairs
                ),
                plot_x="pair",
                plot_y=("ratio",),
            )
        )
        del fresh, fresh_run
        return pairs

    def device_windows(
        self, cfg: TierConfig, timer: DeviceTimer, records: list[StepRecord]
    ) -> dict[str, DeviceWindow] | None:
        """The device times of the timer's windows, recorded per step (None, and a note, when nothing was profiled)."""
        try:
            windows = {
                name: device_window(name, steps, timer.launches, cfg.criteria.device_clip)
                for name, steps in timer.plan.items()
            }
        except ValueError as exc:
            self.report.notes.append(f"{self.nodeid}: device time not measured: {exc}")
            return None
        spans = {r.step: r.gpu_time_s for r in records}
        rows = tuple(
            (
                w.name,
                step,
                round(summed * 1e3, 3),
                round(clipped * 1e3, 3),
                n,
                None if spans.get(step) is None else round(spans[step] * 1e3, 3),
            )
            for w in windows.values()
            for step, summed, clipped, n in zip(w.steps, w.summed_s, w.clipped_s, w.launches)
        )
        self.report.add_series(
            Series(
                self.nodeid,
                "device time of the profiled steps (lora_suite/device_time.py)",
                ("window", "step", "summed launch ms", "clipped launch ms", "launches", "event span ms"),
                rows,
            )
        )
        self.report.add_series(
            Series(
                self.nodeid,
                "where a step's time goes: device busy share of the event span",
                (
                    "window",
                    "steps",
                    "event span ms",
                    "summed launch ms",
                    "clipped launch ms",
                    "launches",
                    "device busy share",
                ),
                tuple(time_budget_rows(records, windows)),
            )
        )
        return windows

    def note_process_memory(self, result: TrainResult) -> None:
        """Say where the run's own GPU memory (the leak series process_gpu_mib) was read from, and that the device-wide
        reading is context (it counts every process on the GPU)."""
        device = "recorded as nvml_used_mib" if any(r.nvml_used_mib is not None for r in result.records) else "no NVML"
        self.report.notes.append(
            f"{self.nodeid}: this process's GPU memory (process_gpu_mib, judged) read from: "
            f"{result.process_memory_source}; the whole GPU's used memory ({device}) is context, never a verdict"
        )

    def record_verdicts(self, judged: LongRunVerdicts) -> None:
        """A long run's verdicts as checks; a criterion without data fails (it is not silently passed)."""
        self.report.add_series(
            Series(
                self.nodeid,
                "leak fit: y = slope*step + intercept",
                ("series", "slope MiB/step", "intercept MiB", "r2", "min MiB", "max MiB"),
                tuple(judged.fits),
            )
        )
        self.report.notes.extend(f"{self.nodeid}: {d}" for d in judged.diagnostics)
        for m in judged.missing:
            self.check(f"measured: {m}", False, "==", True, source="the tier's config judges it; the run gave no data")
        for v in judged.verdicts:
            self.check(v.name, v.value, v.op, v.threshold, source=v.source, detail=v.detail)

    def peak_window(self, name: str) -> PeakWindow:
        """Open a measurement of one run's own peak (``lora_suite.measure.memory.PeakWindow``) and note what it excludes."""
        window = PeakWindow.open()
        self.report.notes.append(
            f"{self.nodeid}: {name}: peak measured net of {window.carried / 2**20:.1f} MiB left "
            f"allocated by earlier work ({window.released / 2**20:.1f} MiB of cached cuBLAS "
            f"workspaces released first){carried_note(window.carried)}"
        )
        return window

    def run_and_measure(self, cfg, quantize, steps=None):
        """Train ``steps`` (default: all) with the given base storage; return (this run's peak bytes, split, records)."""
        name = f"{cfg.tier} ({quantize or cfg.dtype} base)"
        window = self.peak_window(name)
        prepared = self.prepare(cfg, quantize=quantize)
        result = self.train(name, prepared, cfg, stop_step=steps)
        peak = window.peak()
        self.note_process_memory(result)
        self.check_served(prepared)
        split = measured_split(prepared.model, result.optimizer, peak, prepared.adapters)
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
        rows.append(
            ("peak allocated", round(peak / GIB, 4), est["allocated_peak"], round(bf16[0] / GIB, 4) if bf16 else None)
        )
        self.report.add_series(
            Series(
                self.nodeid,
                f"{name}: memory split (GiB)",
                ("part", f"measured ({cfg.lora.quantize or cfg.dtype} base)", "estimated", "measured, 16-bit base"),
                tuple(rows),
            )
        )

    def bf16_baseline(self, cfg: TierConfig):
        """For an NF4 tier: (peak, split) of the same configuration on a 16-bit base; None otherwise."""
        if not cfg.lora.quantize:
            return None
        no_16bit = self.impl.reason_not_applicable("bf16_base")
        if no_16bit:  # e.g. peft-bnb: its base is always bitsandbytes NF4
            self.check.not_applicable("QLoRA peak < 16-bit-base peak (same configuration)", no_16bit)
            return None
        peak, split, _ = self.run_and_measure(cfg, None, cfg.criteria.bf16_comparison_steps)
        return peak, split

    def check_memory(self, cfg: TierConfig, peak: int, bf16) -> None:
        """Peak within the budget of the base actually used, and (NF4) below the 16-bit-base peak."""
        crit, yaml = cfg.criteria, f"configs/{cfg.tier}.yaml"
        record_figure(self.report, self.nodeid, cfg.tier, "peak GPU memory", peak / 2**30, missing_ok=True)
        nf4_skipped = self.configured_quantize and not cfg.lora.quantize
        budget, key = (
            (crit.vram_budget_16bit_base_gib, "vram_budget_16bit_base_gib")
            if nf4_skipped
            else (crit.vram_budget_gib, "vram_budget_gib")
        )
        if budget is None:
            self.check.not_applicable(
                "peak allocated VRAM within budget",
                f"{yaml} sets no {key} for the {'16-bit' if nf4_skipped else cfg.dtype} base this run used",
            )
        else:
            self.check(
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
            self.check(f"{name[:-1]}, {steps} steps)", round(peak / GIB, 3), "<", round(bf16[0] / GIB, 3), unit=" GiB")
        elif nf4_skipped:
            self.check.not_applicable(name, self.impl.reason_not_applicable("nf4_base"))

    def check_peak_vs_estimate(self, cfg: TierConfig, peak_bytes: int) -> None:
        """|estimate − measured| / measured peak within the YAML's memory_estimate_error_max, both sides."""
        bar = cfg.criteria.memory_estimate_error_max
        if bar is None:
            return
        est = self.estimate.allocated_peak
        err = (est - peak_bytes) / peak_bytes
        self.report.notes.append(f"{self.nodeid}: memory estimate {self.estimate.gib()} GiB")
        source = (
            f"configs/{cfg.tier}.yaml memory_estimate_error_max (the estimator must be this close for --check-vram)"
        )
        self.check("estimated vs measured peak allocated, relative error", round(err, 3), "<=", bar, source=source)
        self.check(
            "estimated vs measured peak allocated, relative error (underestimate side)",
            round(err, 3),
            ">=",
            -bar,
            source=source,
        )

    def op_calls(self) -> int | None:
        """LoRA op calls counted by the implementation, or None (recorded as not applicable by the caller)."""
        return None if self.impl.reason_not_applicable("op_call_count") else self.impl.op_calls()
