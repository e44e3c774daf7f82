"""The ``Tier`` a tier test works through: what the tiers share (its config with the command line's overrides,
the VRAM pre-check, model set-up with the LoRA implementation under test, the check that asks that implementation
which path served the layers, training with per-step series and plots in the run report, the note of where a run's
own GPU memory was read from).

A tier's own behaviour lives with that tier, not here: the memory tier's peak measurement and memory verdicts in
``lora_suite.harness.memory_tier`` (the full tier runs them too), the extended tier's long-run records and verdicts
in ``lora_suite.harness.extended_tier`` (its planted-defect self-tests too), anything only one test needs in that
test. A tier is read in its test (tiers/<tier>/test_<tier>_tier.py), its YAML (configs/<tier>.yaml, every threshold,
and its ``suite:`` entry in the tier registry), this file and its own module here, if it has one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lora_suite.engine.models import CheckpointNotFound
from lora_suite.engine.prepare import Prepared, fit_to_implementation, prepare
from lora_suite.engine.step_record import StepRecord
from lora_suite.engine.trainer import TrainResult, train
from lora_suite.harness import recompute_reuse
from lora_suite.harness.checks import Checker
from lora_suite.harness.oom_retry import record_retry, retried_config
from lora_suite.harness.report import RunReport, Series
from lora_suite.implementations.contract import LoRAImplementation
from lora_suite.measure.memory import estimate_tier, vram_verdict
from lora_suite.measure.nvml import nvml_memory
from lora_suite.measure.vram_limit import limited_free
from lora_suite.settings.config import CONFIG_DIR, TierConfig
from lora_suite.settings.loader import load_tier_config


class Tier:
    """What a tier test needs from the session: its config, a prepared model, and the report."""

    def __init__(self, request: pytest.FixtureRequest, run_report: RunReport, check: Checker, impl: LoRAImplementation):
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

    def note_process_memory(self, result: TrainResult) -> None:
        """Say where the run's own GPU memory (the leak series process_gpu_mib) was read from, and that the device-wide
        reading is context (it counts every process on the GPU)."""
        device = "recorded as nvml_used_mib" if any(r.nvml_used_mib is not None for r in result.records) else "no NVML"
        self.report.notes.append(
            f"{self.nodeid}: this process's GPU memory (process_gpu_mib, judged) read from: "
            f"{result.process_memory_source}; the whole GPU's used memory ({device}) is context, never a verdict"
        )
