"""End-to-end training steps against PEFT (issue 10): step time, tokens/s and peak memory per implementation
and mode, on the SmolLM2, TinyLlama and Llama-2-7B architectures (lora_suite/training_bench.py).

Runs, per case: PEFT, the torch reference and cupy, each eager and captured (``train.cuda_graph``), and cupy
compiled (``torch.compile(fullgraph=True, mode="reduce-overhead")``); a ``--lora-impl`` that is none of these is
added. The report has one table of figures and ratios (tokens/s ÷ PEFT eager and ÷ PEFT captured, peak ÷ PEFT
eager), and each pytest-benchmark row's ``extra_info`` the same; the issue's targets are figures to read there,
not timed assertions. Each run's peak is its own (``lora_suite.memory.PeakWindow``): the runs share one process,
and what earlier runs left allocated (cached cuBLAS workspaces, released first; anything else, subtracted and
shown) is not charged to the next one. ``test_eager_speed_interleaved`` measures the eager ratios again with the
implementations' models side by side, taking turns, so that the host's drift between runs is not in them.

Run: ``./scripts/gpu-test.sh bench -- -k training`` (or ``pytest benchmarks/test_bench_training_step.py -m benchmark``).
"""

from __future__ import annotations

import dataclasses
import statistics

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


TURN_STEPS, ROUNDS = 5, 6  # steps per turn; measured rounds (one more round first, as warm-up, left out)
INTERLEAVED_TABLE = (f"eager tokens/s ÷ PEFT eager, implementations taking turns ({ROUNDS} rounds of {TURN_STEPS} "
                     "steps each, after a warm-up round)")
HEADROOM = 4 * 2**30  # bytes beyond the models themselves: one step's activations and the allocator's slack


@pytest.mark.parametrize("case", TB.CASES, ids=[c.name for c in TB.CASES])
def test_eager_speed_interleaved(benchmark, case, run_report):
    """The eager ratios to PEFT with the host's drift taken out: PEFT, the torch reference and cupy models are
    built side by side and train in turns (``TB.rotation``), each turn ``TURN_STEPS`` steps, so a slow moment of
    the host falls on all of them alike; per-round ratios, median and SE (``TB.interleaved_speed``). Skipped,
    with the figures, where the GPU cannot hold the models at once."""
    pytest.importorskip("peft", reason="peft is not installed: the ratios are to PEFT")
    impls = list(IMPLS)
    runs = {}
    for impl in impls:
        cfg = TB.run_config(case, impl, "eager", warmup=TURN_STEPS, measured=ROUNDS * TURN_STEPS)
        before = torch.cuda.memory_allocated()
        prepared = prepare(cfg, "cuda", implementation=resolve_implementation(impl))
        if not runs:
            per_model = torch.cuda.memory_allocated() - before
            free = torch.cuda.mem_get_info()[0]
            need = per_model * (len(impls) - 1) + HEADROOM
            if free < need:
                pytest.skip(f"not enough GPU memory to hold {len(impls)} models at once: {need / 2**30:.1f} GiB "
                            f"more needed, {free / 2**30:.1f} GiB free")
        runs[impl] = {"cfg": cfg, "prepared": prepared, "optimizer": None, "at": 0}
    times = {impl: [] for impl in impls}

    def run_rounds():
        for rnd in range(ROUNDS + 1):
            for impl in TB.rotation(impls, rnd):
                r = runs[impl]
                res = train(r["prepared"].model, r["prepared"].batches, r["cfg"].train, optimizer=r["optimizer"],
                            start_step=r["at"], stop_step=r["at"] + TURN_STEPS, adapters=r["prepared"].adapters)
                r["optimizer"], r["at"] = res.optimizer, r["at"] + TURN_STEPS
                if rnd:
                    times[impl].append(statistics.median(rec.step_time_s for rec in res.records))

    benchmark.group = f"training-interleaved-{case.name}"
    benchmark.pedantic(run_rounds, rounds=1, iterations=1)
    estimates = TB.interleaved_speed(times, "peft")
    tokens = runs["peft"]["cfg"].data.batch_size * runs["peft"]["cfg"].data.seq_len
    info = {"case": case.name, "turn_steps": TURN_STEPS, "rounds": ROUNDS,
            "peft_tokens_per_s": tokens / statistics.median(times["peft"])}
    for impl, est in estimates.items():
        info[f"{impl}_speed_vs_peft_eager"] = est.median
        info[f"{impl}_speed_vs_peft_eager_se"] = est.se
        run_report.add_row("benchmarks", INTERLEAVED_TABLE,
                           ("case", "implementation", "median ratio", "SE", "min", "max", "PEFT median step ms"),
                           (case.name, impl, round(est.median, 3), round(est.se, 3), round(min(est.values), 3),
                            round(max(est.values), 3), round(statistics.median(times["peft"]) * 1e3, 1)))
    benchmark.extra_info.update(info)
    del runs
