"""lora-suite: every target in --help, and a tier added as one YAML plus one test folder, with no Python edited."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lora_suite.cli import TOOLS, registry_names

ROOT = Path(__file__).resolve().parents[3]
TARGETS = [*registry_names(), "all", *TOOLS]  # every target, from the command line's own tables

SMOKE_YAML = """tier: smoke
suite:
  description: "a tier added by a test: one YAML and one test folder"
  order: 5
model: smollm2-135m
lora:
  targets: [q_proj]
  r: 4
  alpha: 8
"""
SMOKE_TEST = """
def test_the_new_tier_runs(run_report):
    assert run_report is not None
"""


def lora_suite(*args, cwd=ROOT, env=None):
    return subprocess.run(
        [sys.executable, "-m", "lora_suite", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


def test_help_lists_every_target():
    out = lora_suite("--help")
    assert out.returncode == 0
    for target in TARGETS:
        assert f"\n    {target} " in out.stdout or f"\n    {target}\n" in out.stdout, target
    assert lora_suite("ledger", "--help").returncode == 0


def test_a_tier_is_one_yaml_and_one_test_folder(tmp_path):
    copy = tmp_path / "checkout"
    shutil.copytree(ROOT, copy, symlinks=True, ignore=shutil.ignore_patterns(".venv", ".git", "reports", ".whl"))
    (copy / "configs" / "smoke.yaml").write_text(SMOKE_YAML)
    (copy / "tiers" / "smoke").mkdir()
    (copy / "tiers" / "smoke" / "test_smoke_tier.py").write_text(SMOKE_TEST)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHON")}
    help_ = lora_suite("--help", cwd=copy, env=env)
    assert "smoke" in help_.stdout and "a tier added by a test" in help_.stdout
    out = lora_suite("smoke", "--report-dir", str(tmp_path / "r"), cwd=copy, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # selected by the marker the registry registered; a tier's tests need a GPU, so here it skips saying so
    assert "1 skipped" in out.stdout and "smoke        NOT JUDGED (no GPU)" in out.stdout  # never PASS
    assert "needs a CUDA GPU" in out.stdout and "nothing was judged (no check ran)" in out.stdout
    assert "PASS" not in out.stdout.split("\nSummary")[1]
    report_path = next((tmp_path / "r").glob("*-smoke/report.json"))
    report = report_path.read_text()
    assert json.loads(report)["run_id"] == report_path.parent.name  # the folder's name is the run id (issue 33)
    assert '"selection": "smoke"' in report  # the tier's marker, registered from the YAML, selected the test
    env["GPU_TEST_DRY_RUN"] = "1"
    assert lora_suite("all", cwd=copy, env=env).stdout.splitlines()[-1].startswith("targets: smoke quick")


def test_a_plain_run_leaves_git_status_clean(tmp_path):
    """Runs go to reports/ (ignored): only --record changes a tracked file (the ledger)."""
    before = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    out = lora_suite("quick", "--", "-k", "nothing_matches_this")
    assert out.returncode == 1 and "FAIL (no tests collected)" in out.stdout  # a run folder was written all the same
    after = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    assert after == before
    run = out.stdout.split("FAIL (no tests collected)")[1].split()[1]
    shutil.rmtree(run)


def test_the_tree_is_linted():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    for cmd in ([ruff, "check", "."], [ruff, "format", "--check", "."]):
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, f"{' '.join(cmd[1:])}:\n{out.stdout[-3000:]}{out.stderr[-1000:]}"


def test_fused_ops_reaches_pytest_and_only_its_one_value_is_taken():
    from lora_suite.cli import build_parser
    from lora_suite.cli.targets import pytest_args
    from lora_suite.settings.registry import registry

    args = build_parser().parse_args(["quick", "--fused-ops", "liger", "--lora-impl", "cupy-fused"])
    cmd = pytest_args("quick", args, None, registry())
    assert cmd[cmd.index("--fused-ops") + 1] == "liger" and cmd[cmd.index("--lora-impl") + 1] == "cupy-fused"
    out = lora_suite("quick", "--fused-ops", "triton")
    assert out.returncode == 2 and "--fused-ops" in out.stderr and "'triton'" in out.stderr


def test_quick_spreads_over_eight_workers_where_a_large_gpu_and_16_cores_are_there(monkeypatch):
    from lora_suite.cli import gpus as G
    from lora_suite.cli import workers as T
    from lora_suite.cli.plugins import AUTOLOAD_ENV

    monkeypatch.setattr(T, "xdist_available", lambda: True)
    monkeypatch.setattr(T.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(G, "gpu_line", lambda: "NVIDIA H100 80GB HBM3, 81559 MiB, 0 MiB, 81000 MiB, 580.159.04")
    monkeypatch.delenv(AUTOLOAD_ENV, raising=False)
    monkeypatch.setenv("GPU_TEST_GPU_COUNT", "1")
    assert T.worker_args("quick", None) == ["-p", "xdist.plugin", "-n", "8", "--dist", "loadgroup"]
    monkeypatch.setattr(T.os, "cpu_count", lambda: 8)
    assert T.worker_args("quick", None)[3] == "4"  # one worker per two cores: each imports torch on its own
    monkeypatch.setattr(T.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(G, "gpu_line", lambda: "NVIDIA A10, 23028 MiB, 0 MiB, 23000 MiB, 550.0")
    assert T.worker_args("quick", None)[3] == "4"  # 22.5 GiB // 4 - 1: each worker peaks near 4 GiB
    monkeypatch.setattr(G, "gpu_line", lambda: None)
    assert T.worker_args("quick", None)[3] == "8"
    assert T.worker_args("quick", "auto")[-3:] == ["auto", "--dist", "loadgroup"]
    assert T.worker_args("quick", "1") == [] and T.worker_args("convergence", None) == []
    monkeypatch.setenv("GPU_TEST_GPU_COUNT", "0")
    assert T.worker_args("quick", None) == []  # no GPU: every test skips, one process is enough


def test_workers_without_xdist_is_a_usage_error_but_the_default_falls_back_saying_so(monkeypatch, capsys):
    from lora_suite.cli import workers as T
    from lora_suite.cli.usage import UsageError

    monkeypatch.setattr(T, "xdist_available", lambda: False)
    monkeypatch.setattr(T.os, "cpu_count", lambda: 16)
    monkeypatch.setenv("GPU_TEST_GPU_COUNT", "1")
    with pytest.raises(UsageError, match="--workers 3 needs pytest-xdist"):
        T.worker_args("quick", "3")
    assert T.worker_args("quick", None) == []
    assert "pytest-xdist is not installed: quick runs in one process" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5"])
def test_a_bad_workers_value_is_named(bad, capsys):
    from lora_suite.cli import main

    assert main(["quick", f"--workers={bad}"]) == 2
    err = capsys.readouterr().err
    assert "--workers" in err and (repr(bad) in err or bad in err)


def test_require_gpu_makes_a_machine_without_one_a_failure_that_names_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "LORA_SUITE_REQUIRE_GPU"}
    for how, extra_env in ((["--require-gpu"], {}), ([], {"LORA_SUITE_REQUIRE_GPU": "1"})):
        out = lora_suite("quick", *how, "--report-dir", str(tmp_path), env={**env, **extra_env})
        assert out.returncode == 4, out.stdout[-2000:] + out.stderr[-2000:]
        assert "no NVIDIA GPU found" in out.stderr and "nothing was judged" in out.stderr
        assert not list(tmp_path.iterdir())  # it stopped before running anything


@pytest.mark.parametrize(
    "verdict, rc, have_gpu, want",
    [
        (
            {"result": "NOT JUDGED", "why": "1 of 1 test(s) skipped: NOT enough free VRAM"},
            0,
            True,
            ("NOT JUDGED (1 of 1 test(s) skipped: NOT enough free VRAM)", 4),
        ),
        (
            {"result": "NOT JUDGED", "why": "1 of 1 test(s) skipped: needs a CUDA GPU"},
            0,
            False,
            ("NOT JUDGED (no GPU)", 0),
        ),
        ({"result": "PASS", "why": "3 check(s) and 1 test(s) passed"}, 0, True, ("PASS", 0)),
        ({"result": "FAIL", "why": "1 check(s) failed"}, 1, True, ("FAIL", 1)),
        ({"result": "FAIL", "why": "x"}, 4, True, ("USAGE ERROR (see above)", 2)),  # pytest usage error
        ({"result": "NOT JUDGED", "why": "x"}, 6, True, ("FAIL (regression vs baseline)", 1)),
    ],
)
def test_the_summary_verdict_and_exit_code_follow_the_run_reports_verdict(tmp_path, verdict, rc, have_gpu, want):
    from lora_suite.cli.verdicts import judged_verdict

    (tmp_path / "report.json").write_text(json.dumps({"verdict": verdict}))
    assert judged_verdict(tmp_path, rc, have_gpu) == want
    assert judged_verdict(tmp_path / "missing", 0, True) == ("FAIL (no run report)", 1)
