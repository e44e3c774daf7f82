"""The regression gate (lora_suite/results/compare.py) on committed H200 benchmark data and synthetic runs."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

from lora_suite.results import compare

ROOT = Path(__file__).resolve().parents[3]
RUNS = Path(__file__).resolve().parents[2] / "fixtures" / "runs"  # recorded run excerpts (README there)
BENCH = RUNS / "20261121T055736Z-bench"  # H200, commit 17bf5be (reports/README.md)


def _write(directory: Path, benchmark=None, report=None) -> Path:
    directory.mkdir(parents=True)
    if benchmark is not None:
        (directory / "benchmark.json").write_text(json.dumps(benchmark))
    if report is not None:
        (directory / "report.json").write_text(json.dumps(report))
    return directory


def _slowed(bench: dict, impl: str, factor: float) -> dict:
    out = copy.deepcopy(bench)
    for row in out["benchmarks"]:
        info = row["extra_info"]
        if info.get("impl") == impl:
            for key in ("cuda_median_ms", "cuda_p20_ms", "cuda_p80_ms"):
                info[key] *= factor
    return out


def test_a_run_against_itself_has_no_regression():
    assert compare.main([str(BENCH), str(BENCH)]) == 0


def test_a_planted_20_percent_slowdown_of_cupy_is_a_regression_naming_the_rows(tmp_path, capsys):
    bench = json.loads((BENCH / "benchmark.json").read_text())
    run = _write(tmp_path / "run", benchmark=_slowed(bench, "cupy", 1.2))
    assert compare.main([str(BENCH), str(run)]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "llama7b-8192tok-4096to4096-r16-cupy" in out
    moved = [ln for ln in out.splitlines() if "-torch]" in ln and "unresolved" not in ln]
    assert not moved  # rows that did not move are listed only where their noise hides a 10% change


def test_noisy_rows_need_a_larger_move(tmp_path):
    """The noisy 4x512 h768 row (p80 0.80 ms over a 0.39 ms median in that run) is too noisy for 20% to count."""
    bench = json.loads((BENCH / "benchmark.json").read_text())
    changes = compare.compare_benchmarks(bench, _slowed(bench, "cupy", 1.2))
    moved = {c.name.split("[")[1] for c in changes if c.regression}
    assert "llama7b-8192tok-4096to4096-r16-cupy]" in moved
    assert "seed-4x512-h768-r16-cupy]" not in moved


def test_faster_is_listed_but_never_fails(tmp_path):
    bench = json.loads((BENCH / "benchmark.json").read_text())
    changes = compare.compare_benchmarks(bench, _slowed(bench, "cupy", 0.7))
    assert changes and not any(c.regression for c in changes)


def test_a_check_that_now_fails_or_disappears_is_a_regression(tmp_path):
    base = {
        "outcomes": [{"test": "t::a", "outcome": "passed"}],
        "checks": [
            {"test": "t::a", "name": "peak", "value": 4.2, "op": "<=", "threshold": 6, "passed": True},
            {"test": "t::a", "name": "drop", "value": 0.4, "op": ">=", "threshold": 0.3, "passed": True},
        ],
    }
    run = {
        "outcomes": [{"test": "t::a", "outcome": "failed"}],
        "checks": [{"test": "t::a", "name": "peak", "value": 6.5, "op": "<=", "threshold": 6, "passed": False}],
    }
    changes = compare.compare_reports(base, run)
    assert {(c.kind, c.after) for c in changes} == {("test", "failed"), ("check", "6.5"), ("check", "(missing)")}
    assert all(c.regression for c in changes)


def _script_compare(base: Path, run: Path) -> subprocess.CompletedProcess:
    """``scripts/gpu-test.sh compare BASE RUN``, its output captured."""
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-test.sh"), "compare", str(base), str(run)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_script_target_runs_compare(tmp_path):
    bench = json.loads((BENCH / "benchmark.json").read_text())
    run = _write(tmp_path / "run", benchmark=_slowed(bench, "cupy", 1.2))
    out = _script_compare(BENCH, run)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "regression(s)" in out.stdout
    copy = tmp_path / "copy"
    shutil.copytree(BENCH, copy)
    same = _script_compare(BENCH, copy)  # the same figures in another run folder: no regression
    assert same.returncode == 0, same.stdout + same.stderr
    itself = _script_compare(BENCH, BENCH)  # a run against itself compares nothing (issue 72): refused
    assert itself.returncode == 2 and "both the baseline and the run" in itself.stderr, itself.stdout + itself.stderr


def test_nothing_to_compare_is_a_usage_error(tmp_path):
    assert compare.main([str(tmp_path), str(tmp_path)]) == 2


def test_runs_of_different_implementations_are_not_compared(tmp_path, capsys):
    report = {"outcomes": [], "checks": [], "implementation": {"name": "cupy"}}
    base = _write(tmp_path / "base", report=report)
    run = _write(tmp_path / "run", report={**report, "implementation": {"name": "peft"}})
    assert compare.main([str(base), str(run)]) == 2
    assert "judged the LoRA implementation 'cupy'" in capsys.readouterr().err
    outcome = [{"test": "t::x", "outcome": "passed"}]  # a baseline must have judged something (issue 28)
    old = _write(tmp_path / "old", report={"outcomes": outcome, "checks": []})  # before schema 3: cupy's
    assert compare.main([str(old), str(base)]) == 0


INTERLEAVED = RUNS / "20261122T134747Z-bench"  # H200, d43484f: runs taking turns (reports/README.md)


def _scaled_ratio(bench: dict, key: str, factor: float) -> dict:
    out = copy.deepcopy(bench)
    for row in out["benchmarks"]:  # a slowdown scales every round's ratio: the median and its SE alike
        for k in (key, f"{key}_se"):
            if k in row["extra_info"]:
                row["extra_info"][k] *= factor
    return out


def test_a_same_mode_ratio_that_fell_20_percent_is_a_regression_a_cross_mode_one_is_not(tmp_path, capsys):
    bench = json.loads((INTERLEAVED / "benchmark.json").read_text())
    assert not [c for c in compare.compare_benchmarks(bench, bench) if c.regression]
    slower = _scaled_ratio(bench, "cupy-captured_speed_vs_peft-captured", 0.8)
    base, run = _write(tmp_path / "base", benchmark=bench), _write(tmp_path / "run", benchmark=slower)
    assert compare.main([str(base), str(run)]) == 1
    assert "cupy-captured_speed_vs_peft-captured" in capsys.readouterr().out
    # The eager ratios' SE (6 rounds of host-bound steps: 5-8%) makes their threshold 21-33%: a 20% move is within it.
    eager = compare.compare_benchmarks(bench, _scaled_ratio(bench, "cupy-eager_speed_vs_peft-eager", 0.8))
    assert not [c for c in eager if c.regression]
    eager = compare.compare_benchmarks(bench, _scaled_ratio(bench, "cupy-eager_speed_vs_peft-eager", 0.6))
    assert len([c for c in eager if c.regression]) == 3
    mixed = _scaled_ratio(bench, "cupy-captured_speed_vs_peft-eager", 0.7)  # a slower host, captured ÷ eager
    changes = compare.compare_benchmarks(bench, mixed)
    assert changes and not any(c.regression for c in changes)
    assert all("host-clocked over a device-clocked" in c.note for c in changes if not c.unresolved)


def test_a_host_clocked_row_is_listed_not_judged(tmp_path):
    bench = json.loads((INTERLEAVED / "benchmark.json").read_text())
    row = copy.deepcopy(bench["benchmarks"][0])
    row["fullname"], row["extra_info"] = (
        "training_step[eager]",
        {"clock": "host", "cuda_median_ms": 100.0, "cuda_p20_ms": 99.0, "cuda_p80_ms": 101.0},
    )
    slow = copy.deepcopy(row)
    slow["extra_info"].update(cuda_median_ms=140.0, cuda_p20_ms=139.0, cuda_p80_ms=141.0)
    (change,) = compare.compare_benchmarks({"benchmarks": [row]}, {"benchmarks": [slow]})
    assert not change.regression and change.note.startswith("host-clocked")
    device = copy.deepcopy(slow)
    del device["extra_info"]["clock"]
    assert compare.compare_benchmarks({"benchmarks": [row]}, {"benchmarks": [device]})[0].regression


def test_a_retired_check_is_not_missing():
    """The H100 extended baseline (before issue 18) still judges a run made after it."""
    base = json.loads(
        (ROOT / "reports" / "baselines" / "NVIDIA_H100_80GB_HBM3" / "extended" / "report.json").read_text()
    )
    run = json.loads(
        (RUNS / "20261124T024657Z-load-acceptance" / "quiet" / "20261124T025530Z-extended" / "report.json").read_text()
    )
    changes = compare.compare_reports(base, run)
    assert not [c for c in changes if c.regression], changes
    (retired,) = [c for c in changes if c.kind == "retired"]
    assert retired.name.endswith(
        "tokens per process CPU-second drift, median of the first vs last 50 steps after warm-up"
    )


def test_a_row_whose_noise_hides_a_ten_percent_change_is_listed_unresolved_and_never_a_regression(capsys, tmp_path):
    """A row within its threshold passes unsaid only where that threshold is at most MIN_REL; a wider one (a noisy
    machine, a second job on the GPU) is listed as unresolved and counted on the verdict line, exit code 0."""
    row = {"fullname": "b::t[x]", "extra_info": {"cuda_median_ms": 1.0, "cuda_p20_ms": 0.9, "cuda_p80_ms": 1.1}}
    quiet = {"fullname": "b::t[y]", "extra_info": {"cuda_median_ms": 1.0, "cuda_p20_ms": 0.999, "cuda_p80_ms": 1.001}}
    base = {"benchmarks": [row, quiet]}
    slower = dict(row, extra_info=dict(row["extra_info"], cuda_median_ms=1.12))
    changes = compare.compare_benchmarks(base, {"benchmarks": [slower, quiet]})
    assert [(c.name, c.unresolved, c.regression) for c in changes] == [("b::t[x]", True, False)]
    for name, data in (("base", base), ("run", {"benchmarks": [slower, quiet]})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "benchmark.json").write_text(json.dumps(data))
    assert compare.main([str(tmp_path / "base"), str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "unresolved" in out and "1 row(s) too noisy to resolve a 10% change" in out and "t[y]" not in out
