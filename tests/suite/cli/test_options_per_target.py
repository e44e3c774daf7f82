"""Options per target (issue 72): an option of some targets only (``preflight.ONLY_FOR``) is listed by exactly those
targets' --help and accepted by exactly those (dry run), refused elsewhere by name; a multinode job over one node and
a comparison of a run with itself are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_suite.cli import build_parser, main
from lora_suite.cli.preflight import ONLY_FOR

RUN = Path(__file__).resolve().parents[2] / "fixtures" / "runs" / "20261122T055507Z-quick"
SAMPLE = {"--gpus": "2", "--nodes": "2", "--node-rank": "0", "--rdzv-endpoint": "h:29500", "--shared-dir": "."}


def _targets():
    sub = next(a for a in build_parser()._actions if a.dest == "target")
    return {name: p for name, p in sub.choices.items() if any(o.dest == "lora_impl" for o in p._actions)}


def test_every_flag_of_some_targets_is_offered_exactly_there(monkeypatch, capsys):
    monkeypatch.setenv("GPU_TEST_DRY_RUN", "1")
    targets = _targets()
    assert {"quick", "multigpu", "multinode", "all"} <= set(targets)
    for flag, only in ONLY_FOR.items():
        for name, parser in targets.items():
            listed = flag in parser.format_help()
            assert listed == (name in only), (flag, name)
            if listed:
                continue
            capsys.readouterr()
            assert main([name, flag, SAMPLE[flag]]) == 2
            assert f"{flag} applies to" in capsys.readouterr().err


def test_a_multinode_job_over_one_node_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("GPU_TEST_DRY_RUN", "1")
    assert main(["multinode", "--nodes", "1"]) == 2
    assert "--nodes must be a whole number >= 2" in capsys.readouterr().err
    assert main(["multinode", "--nodes", "2"]) == 0


def test_a_run_compared_with_itself_is_refused(capsys):
    assert main(["compare", str(RUN), str(RUN) + "/"]) == 2
    assert "both the baseline and the run" in capsys.readouterr().err


@pytest.mark.parametrize("flag", sorted(ONLY_FOR))
def test_only_for_names_real_options(flag):
    assert any(flag in p.format_help() for p in _targets().values())
