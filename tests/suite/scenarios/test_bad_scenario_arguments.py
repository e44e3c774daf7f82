"""The bad-input battery (issue 20), the scenarios' arguments: the multi-GPU launcher's process count and mode, a
batch that does not split over the ranks, the sharing scenario's phases and run counts
(``scripts/sharing-acceptance.sh``) and the memory churner's sizes (``lora_suite.scenarios.memory_churn``), each
refused with what was expected before anything runs or is written."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from lora_suite.settings.config import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[3]

LAUNCH_CASES = {  # what -> (launch_command's keywords, the message)
    "nproc 0": ({"nproc": 0}, "nproc=0 must be >= 1"),
    "nproc -2": ({"nproc": -2}, "nproc=-2 must be >= 1"),
    "mode zero3": ({"nproc": 2, "mode": "zero3"}, "mode 'zero3' is not one of"),
    "mode empty": ({"nproc": 2, "mode": ""}, "mode '' is not one of"),
}


@pytest.mark.parametrize("what", LAUNCH_CASES)
def test_multigpu_launch_options(what, tmp_path):
    from lora_suite.scenarios.multigpu import launch_command

    kw, expected = LAUNCH_CASES[what]
    with pytest.raises(ValueError, match=re.escape(expected)):
        launch_command(CONFIG_DIR / "multigpu.yaml", tmp_path / "out", **kw)
    assert not (tmp_path / "out").exists()


def test_multigpu_batch_that_does_not_split_over_the_ranks():
    from lora_suite.scenarios.multigpu import rank_rows

    with pytest.raises(ValueError, match="the global batch has 7 rows, not divisible by 2 ranks"):
        rank_rows({"input_ids": torch.zeros(7, 4)}, 0, 2)


# ------------------------------------------------------------------ the sharing scenario (issue 28)
SHARING_CASES = [
    (["churny"], "the phase must be pair, plants or churn, got 'churny'"),
    (["pair", "three"], "run counts must be whole numbers >= 0, got 'three'"),
    (["pair", "3", "-1"], "run counts must be whole numbers >= 0, got '-1'"),
    (["churn", "some"], "run counts must be whole numbers >= 0, got 'some'"),
]


@pytest.mark.parametrize("args, expected", SHARING_CASES, ids=[" ".join(a) for a, _ in SHARING_CASES])
def test_sharing_acceptance_arguments(args, expected, tmp_path):
    script = ROOT / "scripts" / "sharing-acceptance.sh"
    out = subprocess.run(["bash", str(script), str(tmp_path / "out"), *args], capture_output=True, text=True)
    assert out.returncode == 2 and expected in out.stderr, out.stderr
    assert not (tmp_path / "out").exists(), "nothing written before the arguments are checked"


CHURN_CASES = [
    (["--hold-gib", "-1"], "--hold-gib must be > 0, got -1.0"),
    (["--period-s", "0"], "--period-s must be > 0, got 0.0"),
    (["--churn-gib", "0.1"], "--churn-gib must be >= 0.25 (the smallest chunk), got 0.1"),
]


@pytest.mark.parametrize("args, expected", CHURN_CASES, ids=[" ".join(a) for a, _ in CHURN_CASES])
def test_memory_churn_arguments(args, expected, capsys):
    from lora_suite.scenarios.memory_churn import parse

    with pytest.raises(SystemExit) as exc:
        parse(args)
    assert exc.value.code == 2 and expected in capsys.readouterr().err
