"""scripts/persist-results.sh (issue 45): a night's runs kept past their artifacts on a results branch, when no store
is configured; two runners pushing at once both land, and a night recorded twice is kept once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RUN = Path(__file__).resolve().parents[2] / "fixtures" / "runs" / "20261122T061557Z-memory"
SCRIPT = ROOT / "scripts" / "persist-results.sh"


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _night(root: Path, stamp: str) -> Path:
    d = root / f"{stamp}-memory"
    shutil.copytree(RUN, d)
    report = json.loads((d / "report.json").read_text())
    report["run_id"] = d.name
    (d / "report.json").write_text(json.dumps(report))
    return root


def _checkout(tmp_path: Path, name: str, remote: Path) -> Path:
    repo = tmp_path / name
    repo.mkdir()
    _git("init", "-q", cwd=repo)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "code", cwd=repo)
    _git("remote", "add", "origin", str(remote), cwd=repo)
    return repo


def _persist(repo: Path, runs: Path, group: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "LORA_SUITE_STORE"}
    return subprocess.Popen(
        ["bash", str(SCRIPT), str(runs), group], cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def _branch_runs(remote: Path) -> list[str]:
    text = _git("show", "results:ledger.jsonl", cwd=remote)
    return sorted(json.loads(line)["run_id"] for line in text.splitlines() if '"kind":"run"' in line)


def test_two_runners_persist_at_once_and_a_night_is_kept_once(tmp_path):
    remote = tmp_path / "remote.git"
    _git("init", "-q", "--bare", str(remote), cwd=tmp_path)
    a, b = _checkout(tmp_path, "a", remote), _checkout(tmp_path, "b", remote)
    night_a = _night(tmp_path / "night-a", "20261126T010000Z")
    night_b = _night(tmp_path / "night-b", "20261126T020000Z")
    procs = [_persist(a, night_a, "nightly-a"), _persist(b, night_b, "nightly-b")]
    outs = [p.communicate(timeout=600)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert _branch_runs(remote) == ["20261126T010000Z-memory", "20261126T020000Z-memory"]
    again = _persist(a, night_a, "nightly-a")
    out = again.communicate(timeout=600)[0].decode()
    assert again.returncode == 0 and "on origin/results already" in out, out
    assert _branch_runs(remote) == ["20261126T010000Z-memory", "20261126T020000Z-memory"]
    assert _git("log", "--format=%s", "results", cwd=remote).split("\n")[0].startswith("results: nightly-")
    assert "code" not in _git("log", "--format=%s", "results", cwd=remote)  # its own history, not the code's


def test_a_missing_runs_folder_is_bad_usage(tmp_path):
    out = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "none"), "g"], capture_output=True, text=True)
    assert out.returncode == 2 and "usage: persist-results.sh RUNS_DIR GROUP" in out.stderr
