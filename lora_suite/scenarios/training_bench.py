"""End-to-end training-step benchmark (issue 10): cases, runs, and the figures compared with PEFT.

A *case* is a model architecture with a LoRA and batch setup; a *run* is one (case, implementation, mode)
with mode ``eager``, ``captured`` (``train.cuda_graph``) or ``compiled`` (the model under
``torch.compile(fullgraph=True, mode="reduce-overhead")``, the optimizer step eager; measured for lora_core's
cupy op, whose registered op keeps the compiled graph whole). Every run trains the random-initialised
architecture with AdamW over fp32 adapters on a bf16 base for ``warmup + measured`` steps; the figures come
from the measured steps only:

    step_ms      median CUDA-event span of a measured step
    tokens_per_s tokens per step / median host wall time of a step
    peak_gib     the run's own peak of torch-allocated memory (``lora_suite.measure.memory.PeakWindow``)

and each run's ratios: tokens/s ÷ PEFT eager's and ÷ PEFT captured's for the same case (the issue's targets are
written against these), peak ÷ PEFT eager's peak and ÷ the peak of PEFT's run in the same mode (captured
runs keep the graph's memory pool: their peak is compared with PEFT captured; compiled with PEFT eager). A run
that cannot be made (compiled with activation checkpointing, captured for an implementation that refuses
capture) is recorded as not applicable with the reason, not dropped. Captured runs of the checkpointed 7B case
capture the recomputation too (``capture.checkpointing_kwargs``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lora_suite.measure.timing import PairedEstimate
from lora_suite.settings.config import CONFIG_DIR, AdapterSpec, DataSettings, TierConfig, TrainSettings
from lora_suite.settings.loader import load_model_config, validate

if TYPE_CHECKING:  # for the annotations only: torch and the engine are imported where they run
    import torch

    from lora_suite.engine.prepare import Prepared

MODES = ("eager", "captured", "compiled")
COMPILED_IMPLEMENTATIONS = ("cupy",)  # issue 10: the op registered for torch.compile


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # configs/models/<model>.yaml
    targets: tuple[str, ...]
    r: int
    batch_size: int
    seq_len: int
    gradient_checkpointing: bool = False


# The cases (issue 10, "Targets"): sizes and LoRA settings as measured there.
CASES = (
    Case("smollm2-qv-r8-8x256", "smollm2-135m", ("q_proj", "v_proj"), 8, 8, 256),
    Case("tinyllama-all-r16-4x512", "tinyllama-1.1b", ("all-linear",), 16, 4, 512),
    Case("llama7b-all-r16-4x512-ckpt", "llama-2-7b", ("all-linear",), 16, 4, 512, gradient_checkpointing=True),
)


def run_config(case: Case, implementation: str, mode: str, *, warmup: int, measured: int) -> TierConfig:
    """The TierConfig of one run: random weights, bf16 base, fp32 adapters, fixed windows (static shapes)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    if warmup < 1 or measured < 2:
        raise ValueError(f"warmup={warmup} (>= 1) and measured={measured} (>= 2) steps")
    train = TrainSettings(
        steps=warmup + measured,
        lr=1e-4,
        warmup_steps=0,
        schedule="constant",
        gradient_checkpointing=case.gradient_checkpointing,
        log_every=warmup + measured,
        cuda_graph=mode == "captured",
        graph_warmup_steps=min(3, warmup),
    )  # compiled: eager steps
    cfg = TierConfig(
        tier=f"bench-training-{case.name}",
        model=load_model_config(case.model, CONFIG_DIR),
        weights="random",
        dtype="bfloat16",
        implementation=implementation,
        lora=AdapterSpec(targets=case.targets, r=case.r, alpha=2 * case.r),
        data=DataSettings(batch_size=case.batch_size, seq_len=case.seq_len, pool=case.batch_size),
        train=train,
    )
    validate(cfg)
    return cfg


def not_applicable(case: Case, mode: str, implementation=None) -> str | None:
    """Why a run cannot be made, or None (``implementation``: a LoRAImplementation, asked about capture)."""
    if mode == "captured" and implementation is not None:
        return implementation.reason_not_applicable("cuda_graph_capture")
    if mode == "compiled" and case.gradient_checkpointing:
        return "compiled runs with activation checkpointing are not measured (the eager run is the 7B figure)"
    if mode == "compiled" and implementation is not None and implementation.name not in COMPILED_IMPLEMENTATIONS:
        return (
            f"compiled runs are measured for {', '.join(COMPILED_IMPLEMENTATIONS)} only (lora_core's registered "
            "op); the issue compares the others eager and captured"
        )
    return None


@dataclass(frozen=True)
class RunFigures:
    step_ms: float
    tokens_per_s: float
    peak_gib: float


def figures(records, tokens_per_step: int, warmup: int, peak_bytes: int) -> RunFigures:
    """The run's figures from its step records, the first ``warmup`` steps left out."""
    measured = records[warmup:]
    if len(measured) < 2:
        raise ValueError(f"{len(records)} records leave {len(measured)} measured steps after {warmup} warm-up steps")
    return RunFigures(
        step_ms=statistics.median(r.gpu_time_s for r in measured) * 1e3,
        tokens_per_s=tokens_per_step / statistics.median(r.step_time_s for r in measured),
        peak_gib=peak_bytes / 2**30,
    )


def ratios(run: RunFigures, peft: dict[str, RunFigures], mode: str = "eager") -> dict[str, float | None]:
    """tokens/s ÷ PEFT eager and ÷ PEFT captured, peak ÷ PEFT eager peak and ÷ PEFT's peak in the same mode
    (``captured`` for a captured run, else ``eager``); None where PEFT's run is absent."""
    eager, captured = peft.get("eager"), peft.get("captured")
    same = captured if mode == "captured" else eager
    return {
        "speed_vs_peft_eager": run.tokens_per_s / eager.tokens_per_s if eager else None,
        "speed_vs_peft_captured": run.tokens_per_s / captured.tokens_per_s if captured else None,
        "peak_vs_peft_eager": run.peak_gib / eager.peak_gib if eager else None,
        "peak_vs_peft_same_mode": run.peak_gib / same.peak_gib if same else None,
    }


def rotation(names: list[str] | tuple[str, ...], round_index: int) -> list[str]:
    """The order of one interleaved round: ``names`` rotated by the round's index, so none always goes first."""
    k = round_index % len(names)
    return list(names[k:]) + list(names[:k])


@dataclass
class TurnRun:
    """One (implementation, mode) run that trains in turns on its prepared model (``lora_suite.engine.prepare``)."""

    prepared: Prepared
    train: TrainSettings
    mode: str
    optimizer: torch.optim.Optimizer | None = None
    at: int = 0  # the next step

    def turn(self, steps: int) -> float:
        """Train ``steps`` more steps; the median host step time (s) of those that represent the mode."""
        from lora_suite.engine.trainer import train

        p = self.prepared
        res = train(
            p.model,
            p.batches,
            self.train,
            optimizer=self.optimizer,
            start_step=self.at,
            stop_step=self.at + steps,
            adapters=p.adapters,
        )
        self.optimizer, self.at = res.optimizer, self.at + steps
        return statistics.median(turn_step_times(res.records, self.mode))


def take_turns(names: list[str], rounds: int, turn, may_fail) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Run ``rounds`` + 1 rounds (the first a warm-up, not kept) of one turn per run, in ``rotation`` order.

    ``turn(name, round)`` runs a turn and returns its representative step time (s). A turn that raises ends
    that run when ``may_fail(name, exc)`` (a peer implementation's failure is a finding about it, and the
    others are still measured: the run's rounds so far are dropped, so every kept run has the same rounds);
    otherwise the exception propagates (the suite's own runs, a CUDA error). Returns (times per kept run,
    what stopped each dropped run)."""
    live, stopped = list(names), {}
    times: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(rounds + 1):
        for name in rotation(live, rnd):
            try:
                t = turn(name, rnd)
            except Exception as exc:
                if not may_fail(name, exc):
                    raise
                stopped[name] = f"round {rnd}: {type(exc).__name__}: {str(exc)[:300]}"
                live.remove(name)
                del times[name]
                continue
            if rnd:
                times[name].append(t)
    return times, stopped


def interleaved_speed(round_step_s: dict[str, list[float]], reference: str) -> dict[str, PairedEstimate]:
    """Speed of each run ÷ the ``reference`` run's, from runs that took turns within rounds.

    ``round_step_s[run][i]``: the median host wall time of a step of ``run``'s turn in round i. Per round,
    speed ratio = reference time / own time (the same tokens per step); the estimate is the median over rounds
    and its standard error (``PairedEstimate``). Taking turns puts the host's drift on every implementation
    alike: runs timed one after another carry it into their ratio (issue 10's 7B eager step, host-bound, read
    1.35× and 0.87× PEFT eager on two H200 runs, reports/20261122T110752Z-bench and …132954Z-bench).
    """
    if reference not in round_step_s:
        raise ValueError(f"reference {reference!r} has no rounds; got {sorted(round_step_s)}")
    ref = round_step_s[reference]
    lengths = {name: len(v) for name, v in round_step_s.items()}
    if len(set(lengths.values())) != 1 or len(ref) < 3:
        raise ValueError(f"every implementation needs the same number (>= 3) of rounds, got {lengths}")
    bad = {name: v for name, v in round_step_s.items() if not all(t > 0 for t in v)}
    if bad:
        raise ValueError(f"step times must be positive seconds, got {bad}")
    return {
        name: PairedEstimate.of([r / t for r, t in zip(ref, times)])
        for name, times in round_step_s.items()
        if name != reference
    }


def turn_step_times(records, mode: str) -> list[float]:
    """Host wall times (s) of the steps of one interleaved turn that represent ``mode``.

    Eager: every step. Captured: the replays after the first, which also captured the graph (the turn's first
    ``graph_warmup_steps`` steps run eagerly on a side stream, as every capture needs). A turn that replayed
    fewer than two steps is an error, not a figure.
    """
    if mode == "eager":
        times = [r.step_time_s for r in records if not r.captured]
        if len(times) != len(records):
            raise ValueError(f"an eager turn replayed {len(records) - len(times)} of {len(records)} steps")
    elif mode == "captured":
        times = [r.step_time_s for r in records if r.captured][1:]
        if len(times) < 2:
            raise ValueError(
                f"a captured turn of {len(records)} steps left {len(times)} replays after the capture "
                "(need >= 2): lengthen the turn"
            )
    else:
        raise ValueError(f"mode {mode!r} is not 'eager' or 'captured'")
    return times
