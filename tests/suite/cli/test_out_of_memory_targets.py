"""Issue 56, item 7: a target that ran out of memory is a FAIL saying so, and the targets after it still run (the
out-of-memory verdict released the GPU); any other failure still stops them without --continue-on-error."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from lora_suite.cli import targets as T
from lora_suite.cli.verdicts import judged_verdict, ran_out_of_memory
from lora_suite.measure.card import OOM_CHECK

OOM = {"name": f"{OOM_CHECK} at step 3, backward", "passed": False}
OTHER = {"name": "loss decreased", "passed": False}
PASSED = {"name": "vram within budget", "passed": True}


def write_report(folder, checks):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps({"status": "complete", "checks": checks}))
    return folder


@pytest.mark.parametrize(
    "checks, expected",
    [
        ([OOM, PASSED], True),
        ([OOM, OOM], True),
        ([OOM, OTHER], False),
        ([OTHER], False),
        ([PASSED], False),
        ([], False),
    ],
)
def test_a_run_failed_only_by_running_out_of_memory_is_told_apart(tmp_path, checks, expected):
    assert ran_out_of_memory(write_report(tmp_path / "run", checks)) is expected


def test_no_report_is_not_an_out_of_memory(tmp_path):
    assert ran_out_of_memory(tmp_path / "missing") is False and ran_out_of_memory(None) is False


def test_the_summary_says_out_of_memory(tmp_path):
    assert judged_verdict(write_report(tmp_path / "run", [OOM]), 1, True) == ("FAIL (out of memory)", 1)
    assert judged_verdict(write_report(tmp_path / "other", [OTHER]), 1, True) == ("FAIL", 1)


@pytest.mark.parametrize("first, runs_on", [([OOM], True), ([OTHER], False), ([OOM, OTHER], False)])
def test_the_targets_after_an_out_of_memory_still_run(tmp_path, monkeypatch, capsys, first, runs_on):
    ran = []

    def run_one(t, args, extra, tiers, run_dir, have_gpu, setup, baseline):
        ran.append(t)
        write_report(run_dir, first if t == "memory" else [PASSED])
        rc = 1 if t == "memory" else 0
        return f"{t} {judged_verdict(run_dir, rc, have_gpu)[0]}", rc, None

    monkeypatch.setattr(T, "_run_one", run_one)
    args = SimpleNamespace(lora_impl=None, continue_on_error=False, baseline=None, record=False, ledger=None)
    rc = T._run(["memory", "quick"], args, [], {}, tmp_path, have_gpu=True)
    out = capsys.readouterr().out
    assert rc == 1, out  # the out-of-memory is still a failure of the command
    assert ran == (["memory", "quick"] if runs_on else ["memory"]), out
    assert ("ran out of memory" in out) is runs_on and ("stopping" in out) is not runs_on, out
