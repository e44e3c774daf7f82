"""Issue 47's comparison of cupy-fused + Liger with Unsloth, each stack at its own best settings, at the fused
table's three cases (SmolLM2 32x1024, TinyLlama 16x1024, Llama-2-7B 2x1024; all-linear r16, bf16 base) and on the
full tier's workload (``FT.FULL_TIER_CASE``: Llama-2-7B, NF4 base, q/k/v/o r8, 1x512, checkpointing; issue 47 item 3):

    cupy-fused+liger  its step captured in a CUDA graph through the project's trainer (``train.cuda_graph``, as the
                      full tier runs lora_core), the loss included: cupy-fused fuses the LM head and the loss itself
                      (``lora_core.loss_head``; Liger's fused linear cross-entropy, which cannot be captured, is left
                      out of a cupy-fused model)
    unsloth           eager, in a child process (its patched model cannot be captured: issue 47 names eager as its
                      best settings), with its fused cross-entropy

The eager against eager comparison stays in the fused table (``test_bench_fused_table.py``); this one answers what a
user choosing between the two stacks gets from each. Both figures are the step's span on the GPU (CUDA events
around the captured replay, or around forward, backward and optimizer step), the median over the measured steps.
Each case runs ``FT.eager_rounds()`` rounds taken in turns (``FT.schedule``); the summary writes each stack's median
with its spread and the 1.2x target row of ``FC.target_cells`` (beyond the spread, peak no higher in any round).
Run in two commands, each inside 10 minutes on an H100 (issue 57): ``lora-suite bench -- -k "best_settings and
(smollm2 or tinyllama or summary)"`` and ``-k "best_settings and (llama2-7b or qlora or summary)"`` (one case:
``-k "best_settings and (smollm2 or summary)"``); the Qwen2- and Gemma-shaped cases (Liger's Qwen2 and Gemma 2 ops)
a third: ``-k "best_settings and (qwen2 or gemma2 or summary)"``.
"""

from __future__ import annotations

import pytest

from lora_suite.implementations import resolve_implementation
from lora_suite.scenarios import fused_cells as FC
from lora_suite.scenarios import fused_child as CH
from lora_suite.scenarios import fused_table as FT

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark]
CASES = tuple(c for c in FT.EAGER_CASES if not c.name.startswith("llama3")) + (FT.FULL_TIER_CASE,)
QUANTIZE = {FT.FULL_TIER_CASE.name: "nf4"}  # the full tier's workload: NF4 base (bitsandbytes' for Unsloth)
SETTINGS = {"cupy-fused+liger": "captured", "unsloth": "eager"}
RUNS = FT.schedule(CASES, tuple(SETTINGS), rounds=FT.eager_rounds())
WARMUP, MEASURED = 5, 20
TABLE = "each stack at its best settings: cupy-fused+liger captured, Unsloth eager (ms per step, peak GiB)"
TARGET = f"cupy-fused+liger captured against Unsloth eager, issue 47's target ({FC.UNSLOTH_TARGET}x, peak no higher)"
_figs: dict[tuple[str, str], list] = {}


@pytest.mark.parametrize("case,rnd,stack", RUNS, ids=[f"{c.name}-r{r}-{s}" for c, r, s in RUNS])
def test_best_settings(case, rnd, stack, run_report, check):
    reason = FT.unavailable(stack, case)
    if reason:
        check.not_applicable(f"best settings: {stack}", reason)
        pytest.skip(f"not applicable: {reason}")
    if SETTINGS[stack] == "eager":
        try:
            fig = CH.eager_in_child(case, stack, warmup=WARMUP, measured=MEASURED, quantize=QUANTIZE.get(case.name))
        except RuntimeError as exc:  # the child's own error (Unsloth on Gemma 2: its compile), recorded per case
            check.not_applicable(f"best settings: {case.name} {stack}", str(exc)[:600])
            pytest.skip(str(exc)[:200])
    else:
        cfg = FT.stack_config(
            case, stack, "captured", warmup=WARMUP, measured=MEASURED, quantize=QUANTIZE.get(case.name)
        )
        try:
            fig, replayed, served = FT.captured_run(case, stack, cfg)
        except RuntimeError as exc:  # a step the capture refuses (transformers 5.17's eager mask: Gemma 2), named
            check.not_applicable(f"best settings captured: {case.name} {stack}", f"{type(exc).__name__}: {exc}"[:600])
            pytest.skip("capture not possible")
        check(
            f"best settings {case.name} {stack} r{rnd}: steps replayed",
            replayed,
            "==",
            25 - cfg.train.graph_warmup_steps,
        )
        want = resolve_implementation(FT.STACKS[stack][0]).expected_path
        check(f"best settings {case.name} {stack} r{rnd}: the path that served it", served, "==", want)
    _figs.setdefault((case.name, stack), []).append(fig)
    cols = ("case", "round", "stack", "mode", "step ms, round", "peak GiB, round")
    run_report.add_row(
        "benchmarks",
        TABLE,
        cols,
        (case.name, rnd, stack, SETTINGS[stack], round(fig.step_ms, 2), round(fig.peak_gib, 3)),
    )


def test_best_settings_summary(run_report):
    """Each stack's median of the rounds with its spread, and the target row per case (figures, not asserts)."""
    cols = ("case", "stack", "mode", "step ms", "peak GiB", *FC.MEDIAN_SPREAD_COLUMNS)
    for case in CASES:
        for stack, mode in SETTINGS.items():
            if _figs.get((case.name, stack)):
                cells = FC.median_cells(_figs[(case.name, stack)], ("step_ms", "peak_gib"))
                run_report.add_row(
                    "benchmarks", f"{TABLE}: medians of the rounds", cols, (case.name, stack, mode, *cells)
                )
        fused, base = _figs.get((case.name, "cupy-fused+liger"), []), _figs.get((case.name, "unsloth"), [])
        if fused and base:
            row = (case.name, "cupy-fused+liger captured", "unsloth eager", *FC.target_cells(base, fused))
            run_report.add_row("benchmarks", TARGET, ("case", "fused stack", "against", *FC.TARGET_COLUMNS), row)
