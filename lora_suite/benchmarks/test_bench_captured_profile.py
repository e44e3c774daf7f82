"""Why a captured step is slower or heavier than its own eager step (issue 57): the best-settings cases where
cupy-fused+liger's captured step did not beat Unsloth's eager one, each profiled twice in this process, eager
(``step_profile.profile_steps``, as the fused table's profiles) and captured through the project's trainer
(``captured_profile.profile_captured``), both at the best-settings configuration (all-linear r16, random weights;
the full tier's 7B QLoRA workload with its NF4 base).

Tables: the two steps side by side (span, summed kernel time, peak; the captured run's memory by phase and its
reading), the kernel time by kind with the difference, and the kernels whose time differs most. Figures, not timed
assertions; the checks are that each profile recorded kernels and that the profiled steps' losses are finite.

Run: ``lora-suite bench -- -k captured_profile`` (one case: ``-k "captured_profile and tinyllama"``).
"""

from __future__ import annotations

import pytest

from lora_suite.scenarios import captured_profile as CP
from lora_suite.scenarios import fused_table as FT
from lora_suite.scenarios import step_profile as SP

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark]
WARMUP, MEASURED = 5, 20
NAMES = ("smollm2-all-r16-32x1024", "tinyllama-all-r16-16x1024", "qwen2.5-0.5b-all-r16-16x1024")
CASES = tuple(c for c in FT.EAGER_CASES if c.name in NAMES) + (FT.FULL_TIER_CASE,)
QUANTIZE = {FT.FULL_TIER_CASE.name: "nf4"}
SIDE = "captured profile: the captured step against its own eager step (ms per step, GiB)"
KINDS = "captured profile: kernel time by kind, eager and captured (ms per step)"
KERNELS = "captured profile: the kernels whose time differs most (ms per step)"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_captured_profile(case, run_report, check):
    stack = "cupy-fused+liger"
    reason = FT.unavailable(stack, case)
    if reason:
        check.not_applicable(f"captured profile: {case.name} {stack}", reason)
        pytest.skip(f"not applicable: {reason}")
    quantize = QUANTIZE.get(case.name)
    cfg = FT.stack_config(case, stack, "eager", warmup=WARMUP, measured=MEASURED, quantize=quantize)
    with FT.stack_model(cfg, stack) as (prepared, window):
        eager = SP.profile_steps(prepared, cfg)
        eager_peak = window.peak()
    cfg = FT.stack_config(case, stack, "captured", warmup=WARMUP, measured=MEASURED, quantize=quantize)
    with FT.stack_model(cfg, stack) as (prepared, window):
        cap = CP.profile_captured(prepared, cfg, window)
    name = f"captured profile {case.name} {stack}"
    check(f"{name}: eager kernels recorded (ms per step)", round(eager.total_ms, 3), ">", 0)
    check(f"{name}: captured kernels recorded (ms per step)", round(cap.profile.total_ms, 3), ">", 0)
    check(f"{name}: the profiled replays' losses are finite", CP.finite_losses(cap.losses), "==", True)
    mem = cap.memory.gib()
    cols: tuple[str, ...] = (
        "case", "stack", "eager step ms", "eager kernel ms", "captured step ms", "captured kernel ms", "eager peak GiB",
        "captured warm-up peak GiB", "captured capture peak GiB", "allocated at capture GiB", "graph pool GiB",
        "graph pool allocated GiB", "memory reading",
    )  # fmt: skip
    row: tuple[object, ...] = (
        case.name, stack, round(eager.span_ms, 2), round(eager.total_ms, 2), round(cap.profile.span_ms, 2),
        round(cap.profile.total_ms, 2), round(eager_peak / CP.GIB, 3), mem["warmup_peak"], mem["capture_peak"],
        mem["before_capture"], mem["pool_reserved"], mem["pool_allocated"], CP.memory_reading(eager_peak, cap.memory),
    )  # fmt: skip
    run_report.add_row("benchmarks", SIDE, cols, row)
    for kind, e, c, d in CP.kind_differences(eager, cap.profile):
        row = (case.name, stack, kind, round(e, 3), round(c, 3), round(d, 3))
        run_report.add_row(
            "benchmarks", KINDS, ("case", "stack", "kernel kind", "eager ms", "captured ms", "difference ms"), row
        )
    cols = ("case", "kernel", "eager launches", "eager ms", "captured launches", "captured ms", "difference ms")
    for k, el, em, cl, cm, d in CP.kernel_differences(eager, cap.profile):
        row = (case.name, k[:120], round(el, 1), round(em, 3), round(cl, 1), round(cm, 3), round(d, 3))
        run_report.add_row("benchmarks", KERNELS, cols, row)
