"""The fused-stack table of issue 27 (lora_suite/scenarios/fused_table.py says how each figure is measured):
forward / backward / step device time and peak memory of PEFT, PEFT + Axolotl's kernels, PEFT + Liger, cupy,
cupy + Liger, cupy-fused, cupy-fused + Liger and Unsloth (in a child process) at GPU-bound batches (eager), the tiers' batches captured, and the
full tier's 7B QLoRA step captured. A stack whose package is missing is recorded as not applicable with the
exact reason. The last test writes the ratios the issue's targets are written against; they are figures to read,
not timed assertions.

Run: ``lora-suite bench -- -k fused_table``.
"""

from __future__ import annotations

import contextlib
import statistics

import pytest
import torch

from lora_suite.engine.trainer import train
from lora_suite.implementations import ImplementationError, resolve_implementation
from lora_suite.scenarios import fused_table as FT
from lora_suite.scenarios import training_bench as TB

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark]
WARMUP, MEASURED = 3, 10
EAGER = "fused table, eager (GPU-bound batches): median ms per step part, peak GiB"
CAPTURED = "fused table, captured (the tiers' batches): median ms per step, peak GiB"
_eager: dict[tuple[str, str], list] = {}
_captured: dict[tuple[str, str], list] = {}
_na: dict[str, str] = {}


def _available(stack: str) -> str | None:
    impl, liger = FT.STACKS[stack]
    try:
        resolve_implementation(impl)
    except ImplementationError as exc:
        return str(exc)
    if liger:
        import importlib.util

        if importlib.util.find_spec("liger_kernel") is None:
            return "liger_kernel not installed (install lora-gpu-suite[liger])"
    return None


def _skip_if_missing(stack, check):
    if stack not in _na:  # resolved once per stack (setdefault would resolve it on every call)
        _na[stack] = _available(stack) or ""
    reason = _na[stack]
    if reason:
        check.not_applicable(f"fused table: {stack}", reason)
        pytest.skip(f"not applicable: {reason}")


# Two rounds for the small models; one for the 7B/8B ones (a GPU-bound step of hundreds of ms, and a model build of
# ~10 s per run: the device-time budget of one call).
EAGER_RUNS = FT.schedule(FT.EAGER_CASES[:2], FT.STACKS) + FT.schedule(FT.EAGER_CASES[2:], FT.STACKS, rounds=1)


@pytest.mark.parametrize("case,rnd,stack", EAGER_RUNS, ids=[f"{c.name}-r{r}-{s}" for c, r, s in EAGER_RUNS])
def test_fused_table_eager(case, rnd, stack, run_report, check):
    _skip_if_missing(stack, check)
    cfg = FT.stack_config(case, stack, "eager", warmup=WARMUP, measured=MEASURED)
    try:
        if stack in FT.ISOLATED:
            fig = FT.eager_in_child(case, stack, warmup=WARMUP, measured=MEASURED)
        else:
            with FT.stack_model(cfg, stack) as (prepared, window):
                fig = FT.eager_run(prepared, window, cfg, warmup=WARMUP, measured=MEASURED)
    except torch.OutOfMemoryError as exc:
        check.not_applicable(f"fused table: {case.name} {stack}", f"out of memory at this batch: {exc}"[:300])
        pytest.skip("out of memory")
    except RuntimeError as exc:  # an isolated stack's child: its own error, recorded per case
        if stack not in FT.ISOLATED:
            raise
        check.not_applicable(f"fused table: {case.name} {stack}", str(exc)[:600])
        pytest.skip(str(exc)[:200])
    _eager.setdefault((case.name, stack), []).append(fig)
    run_report.add_row(
        "benchmarks",
        EAGER,
        (
            "case",
            "round",
            "stack",
            "fwd ms, round",
            "bwd ms, round",
            "step ms, round",
            "peak GiB, round",
            "served by",
            "fused ops",
        ),
        (
            case.name,
            rnd,
            stack,
            round(fig.fwd_ms, 2),
            round(fig.bwd_ms, 2),
            round(fig.step_ms, 2),
            round(fig.peak_gib, 3),
            fig.served_by,
            fig.fused_ops,
        ),
    )
    check(
        f"fused table {case.name} {stack} r{rnd}: code path that served every LoRA layer",
        fig.served_by,
        "==",
        resolve_implementation(FT.STACKS[stack][0]).expected_path,
    )


CAPTURED_RUNS = FT.schedule(FT.CAPTURED_CASES + (FT.FULL_TIER_CASE,), ("peft", "peft+axolotl", "cupy", "cupy-fused"))


@pytest.mark.parametrize("case,rnd,stack", CAPTURED_RUNS, ids=[f"{c.name}-r{r}-{s}" for c, r, s in CAPTURED_RUNS])
def test_fused_table_captured(case, rnd, stack, run_report, check):
    _skip_if_missing(stack, check)
    qlora = case is FT.FULL_TIER_CASE
    if qlora and not stack.startswith("cupy"):
        check.not_applicable(f"fused table: {case.name} {stack}", "the full tier's NF4 base is lora_core's storage")
        pytest.skip("NF4 base: lora_core stacks only")
    cfg = FT.stack_config(case, stack, "captured", warmup=5, measured=20, quantize="nf4" if qlora else None)
    try:
        fig, replayed, served = _captured_run(case, stack, cfg)
    except (ImplementationError, RuntimeError) as exc:
        check.not_applicable(f"fused table captured: {case.name} {stack}", f"{type(exc).__name__}: {exc}"[:300])
        pytest.skip("capture not possible")
    _captured.setdefault((case.name, stack), []).append(fig)
    run_report.add_row(
        "benchmarks",
        CAPTURED,
        ("case", "round", "stack", "step ms, round", "peak GiB, round", "replayed", "served by"),
        (case.name, rnd, stack, round(fig.step_ms, 2), round(fig.peak_gib, 3), replayed, served),
    )
    check(
        f"fused table captured {case.name} {stack} r{rnd}: steps replayed",
        replayed,
        "==",
        25 - cfg.train.graph_warmup_steps,
    )


def _captured_run(case, stack, cfg):
    """(figures, steps replayed, served_by) of one captured run of ``case`` on ``stack``."""
    with FT.stack_model(cfg, stack) as (prepared, window):
        records = train(prepared.model, prepared.batches, cfg.train, adapters=prepared.adapters).records
        fig = TB.figures(records, case.batch_size * case.seq_len, 5, window.peak())
        return fig, sum(r.captured for r in records), prepared.implementation.served_by(prepared.model)


# The full tier's step lever by lever: without the reuse, with it, and with Liger's RMSNorm, RoPE and SwiGLU on top
# (captured: without Liger's fused linear cross-entropy, liger_ops.LCE_LEFT_OUT)
REUSE_VARIANTS = ("cupy no-reuse", "cupy", "cupy+liger", "cupy-fused no-reuse", "cupy-fused", "cupy-fused+liger")
REUSE_RUNS = FT.schedule((FT.FULL_TIER_CASE,), REUSE_VARIANTS)
REUSE = "full tier's QLoRA step, captured: NF4 bases reused from the checkpointed recompute, or dequantised again"
_reuse: dict[str, list] = {}


@pytest.mark.parametrize("case,rnd,variant", REUSE_RUNS, ids=[f"r{r}-{v.replace(' ', '-')}" for _, r, v in REUSE_RUNS])
def test_full_tier_step_base_reuse(case, rnd, variant, run_report, check):
    """The full tier's step with and without ``lora_core.ops.recompute`` (issue 34, item 2), interleaved in one
    run: step ms, peak GiB, and the bases kept and taken over the run (its eager warm-up steps and the capture:
    replays run no Python)."""
    from lora_core.ops import recompute
    from lora_suite.harness import recompute_reuse

    stack, _, off = variant.partition(" ")
    _skip_if_missing(stack, check)
    cfg = FT.stack_config(case, stack, "captured", warmup=5, measured=20, quantize="nf4")
    before = recompute_reuse.counts()
    with recompute.reuse_disabled() if off else contextlib.nullcontext():
        fig, replayed, _ = _captured_run(case, stack, cfg)
    after = recompute_reuse.counts()
    kept, taken = (after[k] - before[k] for k in ("kept", "taken"))
    _reuse.setdefault(variant, []).append(fig)
    run_report.add_row(
        "benchmarks",
        REUSE,
        ("round", "stack", "step ms, round", "peak GiB, round", "bases kept, run", "bases taken, run"),
        (rnd, variant, round(fig.step_ms, 2), round(fig.peak_gib, 3), kept, taken),
    )
    check(f"{REUSE}: {variant} r{rnd}: steps replayed", replayed, "==", 25 - cfg.train.graph_warmup_steps)
    if off:
        check(f"{REUSE}: {variant} r{rnd}: bases kept with reuse disabled", kept, "==", 0)
    else:
        recompute_reuse.check(check, f"{REUSE}: {variant} r{rnd}", before)


def _r3(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _med(runs: dict, key, attr):
    figs = runs.get(key)
    return None if not figs else statistics.median(getattr(f, attr) for f in figs)


def test_fused_table_summary(run_report):
    """The medians of the rounds and the ratios the issue's targets are written against (figures, not asserts)."""
    cols = ("case", "stack", "fwd ms", "bwd ms", "step ms", "peak GiB")
    for case in FT.EAGER_CASES:
        for stack in FT.STACKS:
            key = (case.name, stack)
            if key in _eager:
                run_report.add_row(
                    "benchmarks",
                    "fused table: medians of the rounds",
                    cols,
                    (
                        case.name,
                        stack,
                        *(round(_med(_eager, key, a), 2) for a in ("fwd_ms", "bwd_ms", "step_ms", "peak_gib")),
                    ),
                )
    cols = ("case", "stack", "step ms", "peak GiB")
    for case in FT.CAPTURED_CASES + (FT.FULL_TIER_CASE,):
        for stack in FT.STACKS:
            key = (case.name, stack)
            if key in _captured:
                row = (case.name, stack, *(round(_med(_captured, key, a), 2) for a in ("step_ms", "peak_gib")))
                run_report.add_row("benchmarks", "fused table, captured: medians of the rounds", cols, row)
    targets = []
    for case in FT.EAGER_CASES:
        f = lambda s, a, c=case.name: _med(_eager, (c, s), a)  # noqa: E731
        for base, what in (
            ("cupy+liger", "step"),
            ("peft+axolotl", "step"),
            ("unsloth", "step"),
            ("peft", "fwd"),
            ("peft", "bwd"),
            ("peft", "step"),
        ):
            for fused in ("cupy-fused", "cupy-fused+liger"):
                speed = FT.ratio(f(base, f"{what}_ms"), f(fused, f"{what}_ms"))
                peak = FT.ratio(f(fused, "peak_gib"), f(base, "peak_gib"))
                targets.append((case.name, fused, base, what, _r3(speed), _r3(peak)))
    for case in FT.CAPTURED_CASES + (FT.FULL_TIER_CASE,):
        g = lambda s, c=case.name: _med(_captured, (c, s), "step_ms")  # noqa: E731
        speed = FT.ratio(g("cupy"), g("cupy-fused"))
        targets.append((case.name, "cupy-fused", "cupy", "captured step", _r3(speed), None))
    for variant in REUSE_VARIANTS:
        if variant in _reuse:
            row = (
                FT.FULL_TIER_CASE.name,
                variant,
                *(round(_med(_reuse, variant, a), 3) for a in ("step_ms", "peak_gib")),
            )
            run_report.add_row(
                "benchmarks", f"{REUSE}: medians of the rounds", ("case", "stack", "step ms", "peak GiB"), row
            )
    for stack, base in (
        ("cupy", "cupy no-reuse"),
        ("cupy-fused", "cupy-fused no-reuse"),
        ("cupy+liger", "cupy"),
        ("cupy-fused+liger", "cupy-fused"),
        ("cupy-fused+liger", "cupy no-reuse"),
    ):
        if stack in _reuse and base in _reuse:
            speed = FT.ratio(_med(_reuse, base, "step_ms"), _med(_reuse, stack, "step_ms"))
            peak = FT.ratio(_med(_reuse, stack, "peak_gib"), _med(_reuse, base, "peak_gib"))
            targets.append((FT.FULL_TIER_CASE.name, stack, base, "captured step", _r3(speed), _r3(peak)))
    cols = ("case", "fused stack", "against", "part", "speed-up", "peak ratio")
    for row in targets:
        run_report.add_row(
            "benchmarks", "fused table: speed-up (base ms / fused ms), peak ratio (fused / base)", cols, row
        )


# (case, stack, base quantisation): TinyLlama 16x1024 on four stacks, SmolLM2 32x1024 and Llama-2-7B 2x1024 where
# fusing was slower than its unfused twin (issue 34), and the full tier's 7B QLoRA step (NF4 base) whose 55 ms target
# needs its profile first; with Liger's ops too, to measure how much of its elementwise time fused norms and RoPE take
PROFILED = (
    [(FT.EAGER_CASES[1], s, None) for s in ("cupy+liger", "cupy-fused+liger", "cupy", "cupy-fused")]
    + [(c, s, None) for c in (FT.EAGER_CASES[0], FT.EAGER_CASES[3]) for s in ("cupy+liger", "cupy-fused+liger")]
    + [(FT.FULL_TIER_CASE, s, "nf4") for s in ("cupy", "cupy-fused", "cupy+liger", "cupy-fused+liger")]
)
TOP_OPS = 15


@pytest.mark.parametrize("case,stack,quantize", PROFILED, ids=[f"{c.name}-{s}" for c, s, _ in PROFILED])
def test_fused_table_kernel_profile(case, stack, quantize, run_report, check):
    """Where a step's device time goes, by kernel kind (eager steps): why a speed target is met or not."""
    _skip_if_missing(stack, check)
    cfg = FT.stack_config(case, stack, "eager", warmup=WARMUP, measured=MEASURED, quantize=quantize)
    with FT.stack_model(cfg, stack) as (prepared, _):
        prof = FT.profile_steps(prepared, cfg)
    cols = ("case", "stack", "kernel kind", "ms per step", "share")
    for kind, ms in sorted(prof.kinds.items(), key=lambda kv: -kv[1]):
        run_report.add_row(
            "benchmarks",
            "fused table: kernel time by kind",
            cols,
            (case.name, stack, kind, round(ms, 2), round(ms / prof.total_ms, 3)),
        )
    cols = ("case", "stack", "host op", "calls per step", "device ms per step (self)", "share")
    for op in prof.ops[:TOP_OPS]:
        run_report.add_row(
            "benchmarks",
            "fused table: device time by the op that launched it",
            cols,
            (case.name, stack, op.name[:120], round(op.calls, 1), round(op.ms, 3), round(op.ms / prof.total_ms, 3)),
        )
    cols = ("case", "stack", "kernel", "launches per step", "ms per step")
    for k in prof.kernels[:12]:
        run_report.add_row(
            "benchmarks",
            "fused table: top kernels",
            cols,
            (case.name, stack, k.name[:120], round(k.launches, 1), round(k.ms, 3)),
        )
