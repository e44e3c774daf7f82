"""End-to-end training steps against PEFT (issue 10): step time, tokens/s and peak memory per implementation
and mode, on the SmolLM2, TinyLlama and Llama-2-7B architectures (lora_suite/training_bench.py).

Runs, per case: PEFT, the torch reference and cupy, each eager and captured (``train.cuda_graph``), and cupy
compiled (``torch.compile(fullgraph=True, mode="reduce-overhead")``); a ``--lora-impl`` that is none of these is
added. The report has one table of figures and ratios (tokens/s ÷ PEFT eager and ÷ PEFT captured, peak ÷ PEFT
eager), and each pytest-benchmark row's ``extra_info`` the same; the issue's targets are figures to read there,
not timed assertions. Each run's peak is its own (``lora_suite.memory.PeakWindow``): the runs share one process,
and what earlier runs left allocated (cached cuBLAS workspaces, released first; anything else, subtracted and
shown) is not charged to the next one.

Run: ``./scripts/gpu-test.sh bench -- -k training`` (or ``pytest benchmarks/test_bench_training_step.py -m benchmark``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lora_suite import training_bench as TB
from lora_suite.implementations import resolve_implementation
from lora_suite.memory import PeakWindow
from lora_suite.prepare import prepare
from lora_suite.trainer import train

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark]

WARMUP, MEASURED = 10, 30
IMPLS = ("peft", "torch", "cupy")  # PEFT first: the others' ratios need its figures
TABLE = "training step, bf16 base, fp32 adapters (median of the measured steps)"
COLUMNS = ("case", "implementation", "mode", "step ms", "tokens/s", "peak GiB", "tokens/s / PEFT eager",
           "tokens/s / PEFT captured", "peak / PEFT eager peak", "peak / PEFT peak, same mode",
           "MiB left by earlier runs (excluded)", "MiB of cached cuBLAS workspaces released before the run")
_peft: dict[str, dict[str, TB.RunFigures]] = {}


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ != "test_training_step":
        return
    impls = list(IMPLS)
    spec = metafunc.config.getoption("lora_impl")
    if spec and spec not in impls:
        impls.append(spec)
    runs = [(c, i, m) for c in TB.CASES for i in impls for m in TB.MODES]
    metafunc.parametrize("case,impl,mode", runs, ids=[f"{c.name}-{i}-{m}" for c, i, m in runs])


def test_training_step(benchmark, case, impl, mode, run_report, check):
    if impl == "peft":
        pytest.importorskip("peft", reason="peft is not installed: no PEFT runs and no ratios")
    implementation = resolve_implementation(impl)
    reason = TB.not_applicable(case, mode, implementation)
    if reason:
        check.not_applicable(f"{case.name} {impl} {mode}", reason)
        pytest.skip(f"not applicable: {reason}")
    cfg = TB.run_config(case, impl, mode, warmup=WARMUP, measured=MEASURED)
    window = PeakWindow.open()  # this run's own peak: earlier runs' cuBLAS workspaces released, the rest excluded
    prepared = prepare(cfg, "cuda", implementation=implementation)
    model = prepared.model
    if mode == "compiled":
        torch._dynamo.reset()
        model = torch.compile(model, fullgraph=True, mode="reduce-overhead")  # a graph break is an error
    result = {}

    def run():
        result["records"] = train(model, prepared.batches, cfg.train, adapters=prepared.adapters).records

    benchmark.group = f"training-{case.name}"
    benchmark.pedantic(run, rounds=1, iterations=1)  # one whole run: its steps are the samples, in extra_info
    tokens = cfg.data.batch_size * cfg.data.seq_len * cfg.train.grad_accum
    fig = TB.figures(result["records"], tokens, WARMUP, window.peak())
    replayed = sum(r.captured for r in result["records"])
    check(f"{case.name} {impl} {mode}: steps replayed from the graph", replayed, "==",
          MEASURED + WARMUP - cfg.train.graph_warmup_steps if mode == "captured" else 0,
          source="the mode under test ran (no silent fallback to eager)")
    check(f"{case.name} {impl} {mode}: code path that served every LoRA layer",
          prepared.implementation.served_by(prepared.model), "==", prepared.implementation.expected_path)
    if impl == "peft":
        _peft.setdefault(case.name, {})[mode] = fig
    rat = TB.ratios(fig, _peft.get(case.name, {}), mode)
    benchmark.extra_info.update({"case": case.name, "impl": impl, "mode": mode, **dataclasses.asdict(fig), **rat,
                                 "carried_gib": window.carried / 2**30, "released_workspaces_gib": window.released / 2**30})
    run_report.add_row("benchmarks", TABLE, COLUMNS,
                       (case.name, impl, mode, round(fig.step_ms, 2), round(fig.tokens_per_s), round(fig.peak_gib, 3),
                        *(None if v is None else round(v, 3) for v in rat.values()),
                        round(window.carried / 2**20, 1), round(window.released / 2**20, 1)))
    del prepared, result, model
    torch._dynamo.reset()
