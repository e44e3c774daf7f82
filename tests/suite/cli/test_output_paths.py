"""Output paths (issue 72): every command that writes a file or folder the user names refuses a path that would
create more than one missing folder (as ``--report-dir``), in one line (exit 2), and creates nothing; a new file in an
existing folder, or in a new folder inside one, is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_suite.cli import main

RUN = Path(__file__).resolve().parents[2] / "fixtures" / "runs" / "20261122T055507Z-quick"  # a recorded run

COMMANDS = {
    "history --html": lambda out: ["history", "--no-ledger", "--html", str(out / "page.html"), str(RUN)],
    "render-scorecard OUT": lambda out: ["render-scorecard", str(out / "card"), str(RUN)],
    "ledger export FILE": lambda out: ["ledger", "export", "--ledger", "{good}", str(out / "x.jsonl")],
    "ledger record --ledger": lambda out: [
        "ledger",
        "record",
        "--ledger",
        str(out / "l.jsonl"),
        "--group",
        "g",
        str(RUN),
    ],
    "ledger import --ledger sqlite": lambda out: [
        "ledger",
        "import",
        "--ledger",
        f"sqlite:///{out}/s.sqlite",
        "{good}",
    ],
}


@pytest.fixture
def good(tmp_path):
    assert main(["ledger", "record", "--ledger", str(tmp_path / "good.jsonl"), "--group", "g", str(RUN)]) == 0
    return tmp_path / "good.jsonl"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_path_in_a_missing_folder_is_refused_and_nothing_is_created(command, good, tmp_path, capsys):
    capsys.readouterr()
    missing = tmp_path / "no" / "such" / "folder"
    argv = [a.replace("{good}", str(good)) for a in COMMANDS[command](missing)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and str(tmp_path / "no" / "such") in err and "Traceback" not in err, err
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("new_folder", [False, True], ids=["existing folder", "a new folder in one"])
def test_a_new_path_in_an_existing_folder_is_written(command, new_folder, good, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    target = out / "new" if new_folder else out
    two_new = new_folder and command == "render-scorecard OUT"  # the scorecard's folder is new itself: out/new/card
    assert main([a.replace("{good}", str(good)) for a in COMMANDS[command](target)]) == (2 if two_new else 0)
    assert two_new or any(target.iterdir())
