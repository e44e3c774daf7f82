"""pytest-benchmark suite: forward+backward of one LoRA linear layer in bf16, against the frozen base.

Rows per shape, in this order: the frozen base layer alone (x Wᵀ and dx), the torch reference backend,
PEFT's LoRA Linear (when peft imports) and the cupy backend, plus ``selected:<name>`` for a --lora-impl that is
not one of these (injected through the implementation contract into a module holding one linear). Each timed call ends with a device
synchronisation, so pytest-benchmark's host timer sees the GPU time; the row's ``extra_info`` also holds
CUDA-event statistics (median, p20, p80 of 50 reps after 10 warm-ups) and ``ratio_to_base``, the
CUDA-event median over the base layer's, measured in the same run. Adapters are bf16 on every row.
The cupy-vs-PEFT bar is judged separately (``test_cupy_ratio_not_above_peft``): base, PEFT and cupy
timed in turns over 7 rounds, per-round ratio differences, a noise allowance and re-measurement. At the three
Llama-7B shapes the ratios to base are also measured interleaved (``test_ratio_to_base_interleaved``) and as
summed kernel time (``test_profile_llama7b_layer``), and ``test_layer_ratio_geomean`` reports the geometric
mean over the shapes (issue 10's layer figure).

Run: ``./scripts/gpu-test.sh bench`` (or ``pytest benchmarks -m benchmark --benchmark-json=...``).
"""

from __future__ import annotations

from statistics import geometric_mean

import pytest
import torch

from lora_suite.engine.benchmarking import (
    NOISE_Z,
    implementation_step,
    kernel_profile,
    layer_step,
    paired_difference,
    ratio_rounds,
)
from lora_suite.measure.timing import PairedEstimate, cuda_time, measure_until_pass

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark]

DEV, DT = "cuda", torch.bfloat16
SHAPES = {  # id: (batch, seq, in, out, r)
    "tiny-1tok-64to64-r8": (1, 1, 64, 64, 8),  # launch-bound: shows the host cost per call
    "seed-4x512-h768-r16": (4, 512, 768, 768, 16),
    "seed-8x256-h1024-r32": (8, 256, 1024, 1024, 32),
    "seed-2x1024-h2048-r16": (2, 1024, 2048, 2048, 16),
    "llama7b-8192tok-4096to4096-r16": (1, 8192, 4096, 4096, 16),
    "llama7b-8192tok-4096to11008-r16": (1, 8192, 4096, 11008, 16),
    "llama7b-8192tok-11008to4096-r16": (1, 8192, 11008, 4096, 16),
}
IMPLS = ("base", "torch", "peft", "cupy", "cupy-nf4")  # cupy-nf4: the same layer over an NF4 base (QLoRA)
CASES = [
    (shape, impl)
    for shape in SHAPES
    for impl in IMPLS  # base first within each shape
    if impl != "cupy-nf4" or shape.startswith("llama7b")
]
_base_ms: dict[str, float] = {}


def _has_peft() -> bool:
    try:
        import peft  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_generate_tests(metafunc):
    """The rows: CASES, plus one per shape for a selected implementation that is not a built-in row."""
    if metafunc.function.__name__ != "test_forward_backward":
        return
    cases = list(CASES)
    spec = metafunc.config.getoption("lora_impl")
    if spec and spec not in IMPLS:
        cases += [(shape, f"selected:{spec}") for shape in SHAPES]
    metafunc.parametrize("shape,impl", cases, ids=[f"{s}-{i}" for s, i in cases])


def test_forward_backward(benchmark, shape, impl, run_report, lora_impl):
    if impl == "peft" and not _has_peft():
        pytest.skip("peft is not installed: no PEFT row")
    batch, seq, k, o, r = SHAPES[shape]
    if impl.startswith("selected:"):
        impl = f"selected:{lora_impl.name}"
        step = implementation_step(lora_impl, batch, seq, k, o, r)
    else:
        step = layer_step(impl, batch, seq, k, o, r)

    def synced_step():
        step()
        torch.cuda.synchronize()

    stats = cuda_time(step, warmup=10, reps=50)
    benchmark.group = shape  # before pedantic(): pytest-benchmark reads the group when the row is made
    benchmark.pedantic(synced_step, rounds=30, iterations=1, warmup_rounds=3)
    info = {
        "shape": shape,
        "impl": impl,
        "tokens": batch * seq,
        "in": k,
        "out": o,
        "r": r,
        "dtype": "bf16",
        "cuda_median_ms": stats.median_ms,
        "cuda_p20_ms": stats.p20_ms,
        "cuda_p80_ms": stats.p80_ms,
    }
    if impl == "base":
        _base_ms[shape] = stats.median_ms
    if shape in _base_ms:
        info["ratio_to_base"] = stats.median_ms / _base_ms[shape]
    benchmark.extra_info.update(info)
    run_report.add_row(
        "benchmarks",
        "forward+backward, bf16 (CUDA events, 50 reps)",
        ("shape", "impl", "median ms", "p20 ms", "p80 ms", "ratio to base"),
        (shape, impl, stats.median_ms, stats.p20_ms, stats.p80_ms, info.get("ratio_to_base")),
    )


def cupy_vs_peft_attempts(shape: str, cupy_impl="cupy"):
    """The bar's measurement: per-round (candidate ratio − PEFT ratio) to the base layer, interleaved. The
    candidate is a built-in row name ("cupy", "torch") or a LoRAImplementation (``implementation_step``)."""
    batch, seq, k, o, r = SHAPES[shape]
    steps = {impl: layer_step(impl, batch, seq, k, o, r) for impl in ("base", "peft")}
    steps["cupy"] = (
        layer_step(cupy_impl, batch, seq, k, o, r)
        if isinstance(cupy_impl, str)
        else implementation_step(cupy_impl, batch, seq, k, o, r)
    )

    def measure():
        ratios = ratio_rounds(steps)
        return paired_difference(ratios["cupy"], ratios["peft"])

    return measure_until_pass(measure, lambda e: e.median - NOISE_Z * e.se <= 0.0)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s.startswith("llama7b")])
def test_cupy_ratio_not_above_peft(shape, check, run_report, lora_impl):
    """The implementation under test (cupy by default) is no slower than PEFT relative to the base layer."""
    name = lora_impl.name
    if name == "peft":
        check.not_applicable(f"{shape}: peft ratio - PEFT ratio to base", "PEFT is the implementation under test")
        pytest.skip("not applicable to --lora-impl peft: PEFT is the implementation under test")
    if not _has_peft():
        pytest.skip("peft is not installed: the cupy-vs-PEFT bar needs it")
    attempts = cupy_vs_peft_attempts(shape, name if name in ("cupy", "torch") else lora_impl)
    for i, a in enumerate(attempts):
        run_report.add_row(
            "benchmarks",
            f"{name} ratio - PEFT ratio to the base layer (7 interleaved rounds)",
            ("shape", "attempt", "median difference", "SE", "verdict"),
            (shape, i + 1, a.estimate.median, a.estimate.se, "pass" if a.passed else "FAIL"),
        )
    # The name stays the same from run to run (the regression gate matches checks by name); attempts go in detail.
    check(
        f"{shape}: {name} ratio - PEFT ratio to base, - {NOISE_Z} SE (best attempt)",
        round(min(a.estimate.median - NOISE_Z * a.estimate.se for a in attempts), 4),
        "<=",
        0.0,
        source="issue bar: no worse than PEFT, same run, interleaved; allowance lora_suite/engine/benchmarking.py; noise "
        "model: the three layers timed in turns (7 rounds, CUDA events on device-bound 8192-token layers), so "
        "the machine's drift lands on all alike; 3 SE of the per-round differences; up to 3 attempts",
        detail=f"{len(attempts)} attempt(s), medians {[round(a.estimate.median, 4) for a in attempts]}",
    )


HOST_SHAPES = [s for s in SHAPES if not s.startswith("llama7b")]  # the 7B shapes are GPU-bound
HOST_IMPLS = ("torch", "peft", "cupy")


@pytest.mark.parametrize("shape", HOST_SHAPES)
def test_host_time_per_call(shape, run_report):
    """Host time of one forward+backward (issue 10: cupy's no higher than the torch reference's): the wall time
    to *issue* 30 calls back to back without synchronising, divided by 30, median of 7 rounds; the device
    queue (about 1000 launches) is not filled by 30 calls of ~15 launches. A figure, not a timed assertion."""
    import statistics
    import time

    batch, seq, k, o, r = SHAPES[shape]
    row: dict[str, float | None] = {}  # implementation -> µs per call; None: not installed
    for impl in HOST_IMPLS:
        if impl == "peft" and not _has_peft():
            row[impl] = None
            continue
        step = layer_step(impl, batch, seq, k, o, r)
        for _ in range(10):
            step()
        rounds = []
        for _ in range(7):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(30):
                step()
            rounds.append((time.perf_counter() - t0) / 30 * 1e6)
        torch.cuda.synchronize()
        row[impl] = statistics.median(rounds)
    cupy_us, torch_us = row["cupy"], row["torch"]
    assert cupy_us is not None and torch_us is not None  # only peft may be missing
    ratio = cupy_us / torch_us
    if shape == HOST_SHAPES[0]:
        _host_profile("cupy", SHAPES[shape], run_report)
    run_report.add_row(
        "benchmarks",
        "host time of one forward+backward, bf16 adapters (µs, issued without sync, median of 7 rounds of 30)",
        ("shape", *HOST_IMPLS, "cupy / torch"),
        (shape, *(None if (us := row[i]) is None else round(us, 1) for i in HOST_IMPLS), round(ratio, 3)),
    )


def _host_profile(impl: str, dims, run_report, calls: int = 300) -> None:
    """Where the host time of ``impl``'s forward+backward goes: cProfile over ``calls`` calls, the functions with
    the most own time, per call (cProfile's own overhead inflates every figure alike: read them as shares)."""
    import cProfile
    import pstats

    step = layer_step(impl, *dims)
    for _ in range(10):
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    prof.disable()
    torch.cuda.synchronize()
    # pstats' table, {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]  # undocumented attribute: typeshed omits it
    total = sum(v[2] for v in stats.values())
    top = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:12]
    for (file, line, name), (_, ncalls, tottime, _, _) in top:
        where = f"{file.rsplit('/', 2)[-1]}:{line}" if line else "(built-in)"
        run_report.add_row(
            "benchmarks",
            f"host profile of {impl}, {dims[2]}x{dims[3]} r{dims[4]}: own time per call (cProfile)",
            ("function", "where", "calls per fwd+bwd", "µs per fwd+bwd", "share"),
            (name[:60], where, round(ncalls / calls, 2), round(tottime / calls * 1e6, 2), round(tottime / total, 3)),
        )


LLAMA7B_SHAPES = [s for s in SHAPES if s.startswith("llama7b")]
PROFILE_IMPLS = ("base", "cupy", "peft")
_interleaved: dict[str, dict[str, float]] = {}  # shape -> impl -> median per-round ratio to base
_kernel_ms: dict[str, dict[str, float]] = {}  # shape -> impl -> summed kernel time of one forward+backward


@pytest.mark.parametrize("shape", LLAMA7B_SHAPES)
def test_ratio_to_base_interleaved(shape, run_report):
    """Each row's forward+backward ÷ the base layer's, the rows timed in turns (7 rounds of 15 reps, per-round
    ratios): the figure issue 10's layer target is read from. The sequential rows of ``test_forward_backward``
    take their 50 reps one row after another, so their ratios also carry the machine's drift between rows: on
    the H200 at 202cb29 the NF4 row, which does strictly more work than the bf16 cupy row, came out 0.11 lower
    than it at 4096->11008 (reports/20261122T110752Z-bench)."""
    batch, seq, k, o, r = SHAPES[shape]
    impls = [i for i in IMPLS if i != "peft" or _has_peft()]
    ratios = ratio_rounds({impl: layer_step(impl, batch, seq, k, o, r) for impl in impls})
    for impl, values in ratios.items():
        est = PairedEstimate.of(values)
        _interleaved.setdefault(shape, {})[impl] = est.median
        run_report.add_row(
            "benchmarks",
            "forward+backward ÷ base layer, interleaved (7 rounds of 15 reps)",
            ("shape", "impl", "median ratio", "SE", "min", "max"),
            (shape, impl, round(est.median, 4), round(est.se, 4), round(min(values), 4), round(max(values), 4)),
        )


@pytest.mark.parametrize("impl", PROFILE_IMPLS)
@pytest.mark.parametrize("shape", LLAMA7B_SHAPES)
def test_profile_llama7b_layer(shape, impl, run_report):
    """Where the time of one forward+backward goes at the Llama-7B shapes, 8192 tokens, r16 (issue 10, item 6):
    each kernel's device time per call (torch.profiler, 5 calls after warm-up), for the base layer, cupy and
    PEFT. The summed kernel time leaves out host gaps and launch latency: its ratio to the base layer's is the
    device-side counterpart of the interleaved ratio."""
    if impl == "peft" and not _has_peft():
        pytest.skip("peft is not installed: no PEFT profile")
    from torch.profiler import ProfilerActivity, profile

    batch, seq, k, o, r = SHAPES[shape]
    step = layer_step(impl, batch, seq, k, o, r)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    calls = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    total, kernels = kernel_profile(prof, calls)
    _kernel_ms.setdefault(shape, {})[impl] = total
    for kern in kernels[:8]:
        run_report.add_row(
            "benchmarks",
            "profile: kernels of one forward+backward, 8192 tok, r16, bf16",
            ("shape", "impl", "kernel", "launches per call", "ms per call", "share"),
            (shape, impl, kern.name[:90], kern.launches, round(kern.ms, 4), round(kern.ms / total, 3)),
        )
    base = _kernel_ms[shape].get("base")
    run_report.add_row(
        "benchmarks",
        "profile: device time of one forward+backward, 8192 tok, r16, bf16",
        ("shape", "impl", "ms per call (sum of kernels)", "kernels", "ratio to base"),
        (shape, impl, round(total, 4), len(kernels), None if base is None else round(total / base, 4)),
    )


def test_layer_ratio_geomean(run_report):
    """Issue 10's layer target (≤ 1.15): per implementation, the geometric mean over the three Llama-7B shapes of
    the interleaved ratio to base and of the kernel-sum ratio to base. A figure, not a timed assertion; needs the
    tests above to have run in this session."""
    kernel_ratio = {
        s: {i: ms / t["base"] for i, ms in t.items() if i != "base"} for s, t in _kernel_ms.items() if "base" in t
    }
    rows = 0
    for label, table in (("interleaved ratio", _interleaved), ("kernel-sum ratio", kernel_ratio)):
        for impl in IMPLS[1:]:
            values = [v for s in LLAMA7B_SHAPES if (v := table.get(s, {}).get(impl)) is not None]
            if len(values) < len(LLAMA7B_SHAPES):  # one shape or more not measured
                continue
            rows += 1
            run_report.add_row(
                "benchmarks",
                "forward+backward ÷ base, geometric mean of the three Llama-7B shapes",
                ("measure", "impl", "geometric mean", *LLAMA7B_SHAPES),
                (label, impl, round(geometric_mean(values), 4), *(round(v, 4) for v in values)),
            )
    if not rows:
        pytest.skip("no implementation was measured at all three Llama-7B shapes in this session (deselected)")
