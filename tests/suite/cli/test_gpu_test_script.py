"""scripts/gpu-test.sh: flags, help, exit codes, and a real run of the quick tier without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora_suite.cli.campaigns import SCORECARD_TIERS
from lora_suite.settings.registry import registry

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gpu-test.sh"
TIERS = registry()


def run(*args, dry=True, timeout=300):
    env = dict(os.environ, NO_COLOR="1")
    if dry:
        env["GPU_TEST_DRY_RUN"] = "1"
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_help_is_the_command_lines_own_with_the_run_flags():
    """--help hands over to lora-suite's (test_cli.py checks that it lists every target)."""
    out = run("--help")
    assert out.returncode == 0
    own = subprocess.run([sys.executable, "-m", "lora_suite", "--help"], capture_output=True, text=True, timeout=300)
    assert out.stdout == own.stdout
    for word in ("--check-vram", "--verbose", "--continue-on-error", "--report-dir", "Exit codes"):
        assert word in out.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        ((), "no target given"),
        (("quick", "--bogus"), "unknown option '--bogus'"),
        (("fast",), "unknown target 'fast'"),
        (("quick", "memory"), "only one target allowed"),
        (("quick", "--lora-impl", "not a name"), "LoRA implementation 'not a name': expected a name"),
        (("quick", "--backend", "cupy"), "--backend was replaced by --lora-impl"),
        (("quick", "--strict-vram"), "--strict-vram only makes sense with --check-vram"),
        (("quick", "--report-dir"), "--report-dir needs a directory"),
        (("quick", "--report-dir", "--check-vram"), "--report-dir needs a directory, got '--check-vram'"),
        (
            ("quick", "--lora-impl", "--verbose"),
            "--lora-impl needs a value (cupy, torch, peft or package.module:factory), got '--verbose'",
        ),
        (("quick", "--report-dir=--check-vram"), "--report-dir needs a directory, got '--check-vram'"),
        (("quick", "--report-dir", "/proc/x"), "--report-dir /proc/x is not a writable directory"),
        (("compare", "only-one"), "compare needs two run directories"),
    ],
)
def test_bad_usage_exits_2_with_a_message(args, message):
    out = run(*args)
    assert out.returncode == 2 and message in out.stderr


def _all_tiers(gpus: int) -> list[str]:
    """The tiers ``all`` runs with ``gpus`` GPUs visible, from the registry: those in ``all``, in order, that fit."""
    return [name for name, t in TIERS.items() if t.entry.in_all and t.entry.gpus <= gpus]


def test_all_expands_to_the_registrys_tiers_in_order_and_those_of_more_gpus_only_where_they_are_visible(monkeypatch):
    monkeypatch.setenv("GPU_TEST_GPU_COUNT", "1")
    out = run("all", "--check-vram", "--continue-on-error")
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == f"targets: {' '.join(_all_tiers(1))}"
    for name in (n for n in _all_tiers(2) if n not in _all_tiers(1)):  # multigpu
        assert f"{name}: not part of this 'all' run (it needs 2 or more GPUs; found 1)" in out.stdout
    monkeypatch.setenv("GPU_TEST_GPU_COUNT", "2")
    out = run("all")
    assert out.stdout.strip() == f"targets: {' '.join(_all_tiers(2))}"


def test_multigpu_target_and_gpus_option():
    assert run("multigpu", "--gpus", "2").stdout.strip() == "targets: multigpu"
    bad = run("multigpu", "--gpus", "two")
    assert bad.returncode == 2 and "--gpus must be a positive whole number, got 'two'" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without a GPU")
def test_quick_without_gpu_says_so_and_passes(tmp_path):
    out = run("quick", "--report-dir", str(tmp_path), dry=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "No NVIDIA GPU found" in out.stdout and "skipped" in out.stdout
    assert "Summary (no GPU: GPU tests were skipped)" in out.stdout
    report = next(tmp_path.glob("*-quick/report.json"))
    assert '"skipped"' in report.read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without a GPU")
def test_a_failing_target_gives_exit_1_and_continue_runs_the_rest(tmp_path):
    # `-- -k nothing_matches` collects no test in each tier: pytest exit 5, which the script counts as a failure
    out = run("all", "--continue-on-error", "--report-dir", str(tmp_path), "--", "-k", "nothing_matches", dry=False)
    assert out.returncode == 1
    assert out.stdout.count("FAIL (no tests collected)") == len(_all_tiers(1))  # every tier ran despite the failures
    stop = run("all", "--report-dir", str(tmp_path), "--", "-k", "nothing_matches", dry=False)
    assert stop.returncode == 1 and "stopping (use --continue-on-error" in stop.stdout


def test_a_report_dir_that_is_a_file_is_refused_before_running(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = run("quick", "--report-dir", str(blocker), dry=False)
    assert out.returncode == 2 and "is not a writable directory" in out.stderr
    assert "=== quick ===" not in out.stdout, "the tier ran before the report directory was checked"


def test_two_runs_in_the_same_second_get_their_own_directories(tmp_path):
    procs = [
        subprocess.Popen(
            ["bash", str(SCRIPT), "quick", "--report-dir", str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, NO_COLOR="1"),
        )
        for _ in range(3)
    ]
    for p in procs:
        p.communicate(timeout=300)
        assert p.returncode == 0
    dirs = sorted(d.name for d in tmp_path.iterdir())
    assert len(dirs) == 3, dirs
    assert all((tmp_path / d / "report.json").exists() for d in dirs)


SLEEPY_PYTHON = """#!/usr/bin/env bash
# A python that is real for the script's import checks and sleeps in place of pytest.
for a in "$@"; do [[ "$a" == pytest ]] && exec {py} -c "import time; time.sleep(60)"; done
exec {py} "$@"
"""


def _all_run_in_quick(tmp_path, fake_python: str) -> subprocess.Popen:
    """``gpu-test.sh all`` with ``fake_python`` in place of pytest, returned once its quick run has begun."""
    import time

    fake = tmp_path / "python"
    fake.write_text(fake_python)
    fake.chmod(0o755)
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "all", "--continue-on-error", "--report-dir", str(tmp_path / "r")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=dict(os.environ, NO_COLOR="1", PYTHON=str(fake)),
    )
    deadline = time.time() + 60
    while not list((tmp_path / "r").glob("*-quick")) and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    return proc


def test_ctrl_c_stops_the_whole_run_with_130_and_a_summary(tmp_path):
    import signal
    import sys

    proc = _all_run_in_quick(tmp_path, SLEEPY_PYTHON.format(py=sys.executable))
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground process group
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert "quick        INTERRUPTED" in out and "=== convergence ===" not in out
    assert "Interrupted (Ctrl-C)" in out


TERM_AWARE_PYTHON = """#!/usr/bin/env bash
# A python that is real for the script's import checks; in place of pytest it notes a SIGTERM and exits 143.
for a in "$@"; do [[ "$a" == pytest ]] && exec {py} -c "
import signal, sys, time
def stop(*_):
    open('{marker}', 'w').write('SIGTERM reached pytest')
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
time.sleep(60)"; done
exec {py} "$@"
"""


def test_sigterm_to_the_command_alone_reaches_pytest_and_stops_the_run_with_143(tmp_path):
    """A job's timeout signals the top process only (``timeout 400 ./scripts/gpu-test.sh ...``): the command hands
    the signal to its pytest run, which writes its report as terminated, instead of dying and leaving it running."""
    import signal
    import sys

    marker = tmp_path / "pytest-got-it"
    proc = _all_run_in_quick(tmp_path, TERM_AWARE_PYTHON.format(py=sys.executable, marker=marker))
    proc.send_signal(signal.SIGTERM)  # the script execs the command: this is the command's process
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, out + err
    assert marker.read_text() == "SIGTERM reached pytest"
    assert "quick        TERMINATED" in out and "=== convergence ===" not in out
    assert "Terminated (SIGTERM)" in out


SLOW_TERM_PYTHON = """#!/usr/bin/env bash
# As TERM_AWARE_PYTHON, but writing its report takes a second after the SIGTERM (a second signal comes meanwhile).
for a in "$@"; do [[ "$a" == pytest ]] && exec {py} -c "
import signal, sys, time
def stop(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(1.5)
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
time.sleep(60)"; done
exec {py} "$@"
"""


def test_a_second_sigterm_while_the_first_is_handled_prints_no_traceback(tmp_path):
    """Issue 56: a job's timeout that signals again (or the whole process group) while pytest writes its report: the
    command waits for the report, prints the summary and exits 143, without a traceback."""
    import signal
    import sys
    import time

    proc = _all_run_in_quick(tmp_path, SLOW_TERM_PYTHON.format(py=sys.executable))
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)  # while the command waits for pytest's report
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, out + err
    assert "Traceback" not in out + err and "quick        TERMINATED" in out, out + err


def test_bootstrap_installs_the_cupy_of_torchs_cuda_major_and_peft(tmp_path):
    """A fresh GPU machine: .venv gets torch, then this project with PEFT and cupy-cuda<major>x."""
    env = dict(os.environ, NO_COLOR="1", GPU_TEST_BOOTSTRAP_DRY_RUN="1", GPU_TEST_ASSUME_GPU="1")
    for major, extra in (("12.8", "cuda12"), ("13.0", "cuda13")):
        out = subprocess.run(
            ["bash", str(SCRIPT), "quick"],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(env, GPU_TEST_TORCH_CUDA=major),
        )
        assert out.returncode == 0, out.stderr
        assert "would run: .venv/bin/python -m pip install -q torch==2.13.0" in out.stdout
        assert (
            f"would run: .venv/bin/python -m pip install -q -e .[peft,test,mutate,loralib,torchtune,peft-bnb,postgres,{extra}]"
            in out.stdout
        )
    cpu = subprocess.run(
        ["bash", str(SCRIPT), "quick"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, NO_COLOR="1", GPU_TEST_BOOTSTRAP_DRY_RUN="1", GPU_TEST_TORCH_CUDA=""),
    )
    assert (
        "-e .[peft,test,mutate,loralib,torchtune,peft-bnb,postgres]" in cpu.stdout
        and "cupy" not in cpu.stdout.split("Setting up")[1]
    )
    odd = subprocess.run(
        ["bash", str(SCRIPT), "quick"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(env, GPU_TEST_TORCH_CUDA="11.8"),
    )
    assert odd.returncode == 1 and "CuPy wheels exist for CUDA 12 and 13 only" in odd.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without a GPU")
def test_baseline_comparison_after_a_target(tmp_path):
    """--baseline DIR compares the new run with DIR/<target>: a CPU quick run against itself passes."""
    first = run("quick", "--report-dir", str(tmp_path / "a"), dry=False)
    assert first.returncode == 0
    (tmp_path / "base").mkdir()
    next((tmp_path / "a").iterdir()).rename(tmp_path / "base" / "quick")
    out = run("quick", "--report-dir", str(tmp_path / "b"), "--baseline", str(tmp_path / "base"), dry=False)
    assert out.returncode == 0, out.stdout[-2000:]
    assert "vs baseline" in out.stdout and "no regression" in out.stdout
    none = run("memory", "--report-dir", str(tmp_path / "c"), "--baseline", str(tmp_path / "base"), dry=False)
    assert none.returncode == 0 and "no baseline for memory" in none.stdout


def _scorecard_dry_run(*args):
    """``gpu-test.sh scorecard ARGS`` saying what it would run; it must succeed."""
    env = {**os.environ, "SCORECARD_DRY_RUN": "1"}
    out = subprocess.run(["bash", str(SCRIPT), "scorecard", *args], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out


def test_scorecard_runs_every_selected_implementation_through_the_tiers_then_builds(tmp_path):
    out = _scorecard_dry_run("--lora-impl", "cupy,peft-bnb", "--report-dir", str(tmp_path), "--check-vram", "--record")
    lines = [line.removeprefix("would run: ") for line in out.stdout.splitlines()]
    tiers = [
        (line.split()[1], line.split()[3]) for line in lines if line.startswith("lora-suite") and "--lora-impl" in line
    ]
    assert tiers == [(t, i) for i in ("cupy", "peft-bnb") for t in SCORECARD_TIERS]
    assert all("--check-vram" in line and "--record" in line for line in lines if "--lora-impl" in line)
    assert not any("--workers" in line for line in lines)  # one lane: quick keeps its default workers
    assert lines[-2].startswith(f"lora-suite bench --report-dir {tmp_path} --record --ledger ")
    assert lines[-2].endswith("-- -k speed_interleaved --bench-impls cupy,peft-bnb")
    assert lines[-1] == f"lora-suite render-scorecard {tmp_path} {tmp_path}"


def test_scorecard_lanes_run_implementations_at_once_each_logged_then_the_bench_alone(tmp_path):
    out = _scorecard_dry_run("--lora-impl", "cupy,peft,loralib", "--report-dir", str(tmp_path), "--jobs", "2")
    for impl in ("cupy", "peft", "loralib"):
        log = (tmp_path / f"lane-{impl}.log").read_text().splitlines()
        assert [line.split()[3] for line in log] == list(SCORECARD_TIERS)  # "would run: lora-suite TIER"
        assert all(f"--lora-impl {impl} " in line for line in log)
        assert all("--workers 1" in line for line in log)  # the lanes are the parallelism: one process a tier
    assert "speed_interleaved --bench-impls cupy,peft,loralib" in out.stdout.splitlines()[-2]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lora-impl", "a b"], "--lora-impl must be names separated by commas, got 'a b'"),
        (["--lora-impl"], "--lora-impl needs a value (cupy, torch, peft or package.module:factory), got ''"),
        (["--report-dir", "--check-vram"], "--report-dir needs a directory, got '--check-vram'"),
        (["--gpus", "2"], "--gpus applies to multigpu and all only, not to 'scorecard'"),
        (["--jobs", "0"], "--jobs must be a positive whole number, got '0'"),
        (["--jobs"], "--jobs needs a whole number >= 1, got ''"),
        (["--no-bench", "x"], "unexpected argument 'x' for scorecard"),
    ],
)
def test_scorecard_refuses_bad_arguments_naming_them(args, message, tmp_path):
    out = subprocess.run(
        ["bash", str(SCRIPT), "scorecard", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "SCORECARD_DRY_RUN": "1"},
    )
    assert out.returncode == 2 and message in out.stderr


def test_a_relative_report_dir_is_the_callers(tmp_path):
    """Issue 28: gpu-test.sh changed to the checkout before handing over, so `--report-dir out` landed in the checkout."""
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run(
        ["bash", str(root / "scripts" / "gpu-test.sh"), "quick", "--report-dir", "out", "--", "-k", "matches_nothing"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "GPU_TEST_DRY_RUN"},
    )
    assert out.returncode == 1 and "FAIL (no tests collected)" in out.stdout, out.stdout[-1500:] + out.stderr[-800:]
    assert list((tmp_path / "out").glob("*-quick")), "the run folder is not under the caller's out/"
