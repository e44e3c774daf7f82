"""pytest-benchmark suite: the time to merge LoRA adapters into the base weights (W' = W + s·B·A) and to unmerge them
(W = W' − s·B·A), what a user pays to export a trained adapter or to switch adapters while serving, on one Llama-2-7B
decoder layer's seven linears (q/k/v/o 4096→4096, gate/up 4096→11008, down 11008→4096; r16, alpha 32, bf16 base and
adapters). ``lora_suite/scenarios/merge_bench.py`` says how each figure is measured and guarded.

Rows: ``test_merge[llama7b-layer-r16-<impl>]`` and ``test_unmerge[llama7b-layer-r16-<impl>]`` for lora_core's ``cupy``
and ``torch`` (the reference), ``peft`` when it imports, and ``selected:<spec>`` for a ``--lora-impl`` that is none of
these (injected and merged through the implementation contract, ``merge_adapters``). An implementation that cannot
merge (``merge_reason``), or whose merge leaves nothing to unmerge (lora_core's: plain linears), gets a report row and a
not-applicable check saying why, and its test is skipped.

One measurement serves every row (``merge_rounds``): a warm-up pass, then 9 rounds in turns (each round every
operation 5 times, the order rotated; 7 rounds of 3 left a round-to-round spread of 3-4% on an H100, too wide for
``compare`` to resolve a 10% change), each call on a fresh copy of the saved layer made outside the timed region,
device-clocked with CUDA events. A row's ``extra_info``: ``cuda_median_ms`` (the median of its rounds, what ``compare``
judges) with the rounds' p20 and p80 (its spread for ``compare``) and least and greatest round, the per-round ratio to
the torch reference's merge in the same round, and that speed with its SE (``compare`` judges a fall beyond it).
Every timed call is guarded: with the adapters zeroed, a merged layer must give the adapted function and an unmerged
one the base function, within bf16's parity tolerance; a row with a failed call fails and writes no benchmark row.
pytest-benchmark's own statistics (host clock, each call synchronised, 5 calls on fresh copies) sit beside them.

Run: ``./scripts/gpu-test.sh bench -- -k test_bench_merge`` (add ``--lora-impl <name>`` for its ``selected:`` rows).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lora_suite.implementations import ImplementationError, LoRAImplementation, resolve_implementation
from lora_suite.scenarios import merge_bench as MB

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark]

BUILT_IN = ("torch", "cupy", "peft")  # torch: the reference every ratio is to
HOST_ROUNDS = 5
TABLE = (
    f"merge and unmerge of one Llama-2-7B layer's seven linears, r{MB.R}, bf16 (CUDA events: median of "
    f"{MB.ROUNDS} rounds in turns, {MB.REPS} calls a round)"
)
COLUMNS = ("operation", "impl", "median ms", "least round ms", "greatest round ms", "÷ torch merge", "range", "verdict")
NOT_TIMED = "merge and unmerge: implementations not timed, and why"
GUARD_SOURCE = (
    "tol = 8·(u_bf16 + u_fp32·√in) against float64 (lora_suite/judges/parity.py), the bound layer_checks.merged "
    "judges a merge by; the adapters the layer still holds zeroed first (invariant_checks.merge_folds)"
)


def _rows(config) -> list[str]:
    """BUILT_IN, plus ``selected:<spec>`` for a --lora-impl that is not one of them."""
    spec = config.getoption("lora_impl")
    return list(BUILT_IN) + ([f"selected:{spec}"] if spec and spec not in BUILT_IN else [])


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ in ("test_merge", "test_unmerge"):
        rows = _rows(metafunc.config)
        metafunc.parametrize("row", rows, ids=[MB.row_id(r) for r in rows])


@pytest.fixture(scope="module")
def merge_rounds(request, lora_impl) -> MB.Measured:
    """Every row's merge and unmerge, timed in rounds in turns and guarded (``merge_bench.measure``)."""
    candidates: dict[str, LoRAImplementation | str] = {}  # row -> implementation, or why it cannot run
    for row in _rows(request.config):
        if row.startswith("selected:"):
            candidates[row] = lora_impl
        elif row == "peft" and importlib.util.find_spec("peft") is None:
            candidates[row] = "peft is not installed: no PEFT rows"
        else:
            try:
                candidates[row] = resolve_implementation(row)
            except ImplementationError as exc:
                candidates[row] = str(exc)
    measured = MB.measure(candidates, MB.cuda_event_ms, device="cuda")
    torch.cuda.empty_cache()
    return measured


def _judged(kind: str, row: str, measured: MB.Measured, run_report, check) -> bool:
    """Skip a row that is not timed (with its report row and not-applicable check); check its guard and the guard's
    reach. True when every timed call of the row passed its guard."""
    key, name = (row, kind), f"{kind} {MB.row_id(row)}"
    reason = measured.not_applicable.get(key)
    if reason is not None:
        run_report.add_row("benchmarks", NOT_TIMED, ("operation", "impl", "why"), (kind, row, reason))
        check.not_applicable(f"{name}: timed", reason)
        pytest.skip(f"not applicable: {reason}"[:300])
    want = "adapted" if kind == "merge" else "base"
    failures = measured.rounds.failures[key]
    calls = 1 + MB.ROUNDS * MB.REPS
    check(
        f"{name}: calls whose layer, adapters zeroed, was not the {want} function (of {calls})",
        len(failures),
        "==",
        0,
        source=GUARD_SOURCE,
        detail="; ".join(f[:400] for f in failures[:3]),
    )
    check(
        f"{name}: the guard tells the adapted function from the base one (least distance over the projections, "
        "in tolerances)",
        round(measured.reach, 3),
        ">",
        1.0,
        source="a merge that did nothing gives the base function: the guard must fail it",
    )
    return not failures and measured.reach > 1.0


def _timed_row(benchmark, kind: str, row: str, measured: MB.Measured, run_report) -> None:
    """pytest-benchmark's row (host clock, each call on a fresh copy, synchronised) with the rounds' figures."""
    op = measured.ops[(row, kind)]

    def setup():
        module = op.prepare()
        torch.cuda.synchronize()  # the copy is not the call's
        return (module,), {}

    def call(module):
        op.run(module)
        torch.cuda.synchronize()

    benchmark.group = f"{kind}-{MB.LAYER}"  # before pedantic(): pytest-benchmark reads the group when the row is made
    benchmark.pedantic(call, setup=setup, rounds=HOST_ROUNDS, warmup_rounds=1)
    fig = MB.figures(measured.rounds.times, (row, kind))
    benchmark.extra_info.update(
        {
            "layer": MB.LAYER,
            "impl": row,
            "operation": kind,
            "shapes": {path: list(dims) for path, dims in MB.SHAPES.items()},
            "r": MB.R,
            "alpha": MB.ALPHA,
            "dtype": "bf16",
            "reps_per_round": MB.REPS,
            **fig,
        }
    )
    ratio = fig.get("ratio_to_torch_merge")
    spread = None if ratio is None else f"{fig['ratio_to_torch_merge_low']:.3f}-{fig['ratio_to_torch_merge_high']:.3f}"
    verdict = "the reference" if (row, kind) == (MB.REFERENCE, "merge") else fig.get("vs_torch_merge")
    run_report.add_row(
        "benchmarks",
        TABLE,
        COLUMNS,
        (
            kind,
            row,
            round(fig["cuda_median_ms"], 3),
            round(fig["cuda_low_ms"], 3),
            round(fig["cuda_high_ms"], 3),
            None if ratio is None else round(ratio, 3),
            spread,
            verdict,
        ),
    )


def test_merge(benchmark, row, merge_rounds, run_report, check):
    """W' = W + s·B·A through the implementation's merge, timed and guarded (module docstring)."""
    if _judged("merge", row, merge_rounds, run_report, check):
        _timed_row(benchmark, "merge", row, merge_rounds, run_report)


def test_unmerge(benchmark, row, merge_rounds, run_report, check):
    """W = W' − s·B·A through the unmerge of the merged layers, where they have one; timed and guarded."""
    if _judged("unmerge", row, merge_rounds, run_report, check):
        _timed_row(benchmark, "unmerge", row, merge_rounds, run_report)
