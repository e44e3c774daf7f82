"""Stand-ins for ``lora-suite mutate``'s CPU self-tests (``test_mutate.py``, ``test_mutation_errors.py``): a tiny
torch-free stack (``calc.py``), a stand-in for the quick tier that writes a report.json as the suite's run report
does (and prints a crash's traceback, as pytest does), a stand-in fingerprint, and the plan that runs them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lora_suite.mutation import equivalence as EQ
from lora_suite.mutation import mutant_source
from lora_suite.mutation import mutation_run as MR

ROOT = Path(__file__).resolve().parents[3]

CALC = """\
def scale(alpha, r):
    return alpha / r


def double(x):
    unused = x * 1
    return x * 2


def shifted(x):
    k = 1
    return x + k


def count(n):
    i = 0
    while i < n:
        i += 1
    return i
"""

# The stand-in for the quick tier: a process that loads the (mutated) module the way the pytest plugin does and
# writes a report.json of checks and outcomes as the suite's run report does.
CHECKS = """\
import json, os, sys, traceback
from pathlib import Path

from lora_suite.mutation.mutant_source import install_from_env

install_from_env()
import calc

TESTS = {
    "check_calc.py::test_scale": ("scale(8, 4) is 2", lambda: calc.scale(8, 4) == 2),
    "check_calc.py::test_double": ("double(0) is 0", lambda: calc.double(0) == 0),
    "check_calc.py::test_shifted": ("shifted(1) is 2", lambda: calc.shifted(1) == 2),
    "check_calc.py::test_count": ("count(3) is 3", lambda: calc.count(3) == 3),
}
checks, outcomes = [], []
for test in sys.argv[2:] or TESTS:  # the order given, else the file's; stop at the first failure, as -x does
    os.environ["PYTEST_CURRENT_TEST"] = f"{test} (call)"
    name, ok = TESTS[test]
    try:
        checks.append({"test": test, "name": name, "passed": bool(ok())})
        outcomes.append({"test": test, "outcome": "passed" if checks[-1]["passed"] else "failed", "reason": ""})
    except Exception as exc:
        traceback.print_exc()  # as pytest prints a failure's traceback: the frames name the mutated file
        outcomes.append({"test": test, "outcome": "failed", "reason": f"{type(exc).__name__}: {exc}"})
    if outcomes[-1]["outcome"] == "failed":
        break
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
(out / "report.json").write_text(json.dumps({"checks": checks, "outcomes": outcomes}))
sys.exit(0 if all(o["outcome"] == "passed" for o in outcomes) else 1)
"""

FINGERPRINT = """\
import json
from lora_suite.mutation.mutant_source import install_from_env

install_from_env()
import calc

print(json.dumps({f"double({x})": repr(calc.double(x)) for x in (0, 3)}))
"""


def calc_folder(tmp_path: Path) -> tuple[Path, dict]:
    """``calc.py``, its checks and its fingerprint written in ``tmp_path``; the folder and the runs' environment."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "calc.py").write_text(CALC)
    (tmp_path / "check_calc.py").write_text(CHECKS)
    (tmp_path / "fingerprint_calc.py").write_text(FINGERPRINT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    for var in (mutant_source.MODULE_ENV, mutant_source.FILE_ENV):
        env.pop(var, None)
    return tmp_path, env


def calc_plan(folder: Path, env: dict, **kw) -> MR.Plan:
    """The plan of a mutation run of ``calc.py`` by two operators, through the stand-ins; ``kw`` overrides."""
    defaults = dict(
        targets=(MR.Target(folder / "calc.py", "calc", "calc.py"),),
        command=lambda report, order: [sys.executable, str(folder / "check_calc.py"), str(report), *order],
        env=env,
        fingerprint=EQ.subprocess_fingerprint([sys.executable, str(folder / "fingerprint_calc.py")]),
        workers=2,
        operators=("DeleteStatement", "ReplaceBinaryOperator_Mul_Div"),
        timeout_slack_s=2.0,
        alone_factor=1.0,
        log=lambda line: None,
    )
    return MR.Plan(**{**defaults, **kw})
