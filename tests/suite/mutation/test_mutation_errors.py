"""``lora-suite mutate``'s two scores and its errors (``lora_suite.mutation.check_run``, ``mutate``,
``mutation_report``, ``cli.mutation``): a run that judged nothing is an error, never a kill, and is in neither score;
a crash inside the mutated file is still a kill; a run where every mutant errors has no score and fails; a survivor
of an operator whose class the fingerprint cannot see is never called equivalent."""

from __future__ import annotations

import math
import sys

import pytest

pytest.importorskip("cosmic_ray", reason="the mutate extra (cosmic-ray) is not installed")

from lora_suite.mutation import check_run as C  # noqa: E402
from lora_suite.mutation import mutant_source  # noqa: E402
from lora_suite.mutation import mutate as M  # noqa: E402
from lora_suite.mutation import mutation_report as R  # noqa: E402
from lora_suite.mutation import mutation_run as MR  # noqa: E402
from tests.suite.mutation.mutation_standins import calc_folder, calc_plan  # noqa: E402

MUTANT = "/tmp/mutants/mutant-0003/calc.py"
CRASH = {"test": "t.py::test_a", "outcome": "error", "reason": "RuntimeError: CUDA out of memory", "location": ""}


@pytest.mark.parametrize(
    "report, rc, output, killed, error",
    [
        (None, 4, "ImportError: cannot import name 'plugin'", "", "no report.json: the harness did not run (exit 4"),
        ({"checks": [], "outcomes": []}, 2, "1 error during collection", "", "no test ran: nothing collected"),
        ({"outcomes": [{"test": "t.py::test_a", "outcome": "skipped"}]}, 0, "", "", "all 1 test(s) skipped"),
        ({"outcomes": [CRASH]}, 1, "E RuntimeError", "", "crashed outside the code under test (RuntimeError: CUDA"),
        ({"outcomes": [CRASH]}, 1, f'File "{MUTANT}", line 3', "t.py::test_a: RuntimeError: CUDA out of memory", ""),
        ({"checks": [{"name": "c", "passed": False, "test": "t.py::test_a"}]}, 1, "", "check 'c' (t.py::test_a)", ""),
        (
            {"outcomes": [{"test": "t.py::test_b", "outcome": "passed"}, CRASH]},
            1,
            "",
            "t.py::test_a: RuntimeError: CUDA out of memory",
            "",
        ),
        ({"checks": [{"name": "c", "passed": True}], "outcomes": [{"outcome": "passed"}]}, 0, "", "", ""),
    ],
)
def test_a_run_that_judged_nothing_is_an_error_and_a_crash_of_the_mutated_code_a_kill(
    report, rc, output, killed, error
):
    why, _ = C.killed_by(report, rc, output, MUTANT)
    assert why == killed
    nothing = "" if why else C.nothing_judged(report, rc, output)
    assert (error in nothing) if error else nothing == ""


BROKEN_HARNESS = """\
import os, runpy, sys
if os.environ.get({var!r}):  # every mutant's run: the harness fails to import before any test
    print("ImportError: cannot import name 'plugin' from 'lora_suite.harness'", file=sys.stderr)
    sys.exit(4)
runpy.run_path({checks!r}, run_name="__main__")
"""


def test_when_every_mutant_judges_nothing_there_is_no_score_and_the_run_fails(tmp_path):
    folder, env = calc_folder(tmp_path / "stack")
    script = folder / "broken_harness.py"
    script.write_text(BROKEN_HARNESS.format(var=mutant_source.FILE_ENV, checks=str(folder / "check_calc.py")))
    plan = calc_plan(folder, env, command=lambda report, order: [sys.executable, str(script), str(report), *order])
    run = M.execute(plan, tmp_path / "work")
    assert run.results and {r.status for r in run.results} == {"error"}
    assert all(r.killed_by == "" for r in run.results)
    assert all(r.reason.startswith("no report.json: the harness did not run (exit 4: ImportError") for r in run.results)
    assert all(r.reason.endswith("(twice: beside the others, then alone)") for r in run.results)
    assert run.counts() == (0, 0, 0) and run.count("error") == len(run.results)
    assert MR.score(0, 0) is None and MR.score_counting_equivalents(0, 0, 0) is None
    report = R.build(run, "r", plan.targets, "calc:make", 0.9)
    check = report.checks[0]
    assert math.isnan(check.value) and not check.passed
    assert (
        check.detail
        == f"no mutant was killed or survived ({len(run.results)} error(s), 0 equivalent): nothing was judged"
    )
    from lora_suite.cli import mutation

    line = mutation.nothing_judged(run)
    assert (
        line
        == f"no mutant was killed or survived: {len(run.results)} of {len(run.results)} judged nothing (error) and 0 are equivalent"
    )
    assert mutation.summary(run, check, 0.9).startswith(
        "mutation score n/a (killed / (killed + survived); threshold >= 0.9): FAIL; n/a with"
    )


@pytest.mark.parametrize(
    "killed, survived, equivalent, expected",
    [(121, 9, 26, 121 / 156), (118, 9, 24, 118 / 151), (3, 0, 1, 0.75), (0, 0, 5, None), (0, 0, 0, None)],
)
def test_the_second_score_counts_every_equivalent_as_a_survivor(killed, survived, equivalent, expected):
    assert MR.score_counting_equivalents(killed, survived, equivalent) == expected
    if expected is not None:  # the published figures: 0.931 -> 0.776 (the example), 0.929 -> 0.781 (PEFT's glue)
        assert MR.score_counting_equivalents(killed, survived, equivalent) <= MR.score(killed, survived)
    with pytest.raises(ValueError, match="equivalent=-1"):
        MR.score_counting_equivalents(killed, survived, -1)


def test_the_summary_line_prints_both_scores(tmp_path):
    from lora_suite.cli import mutation

    statuses = ("killed", "killed", "killed", "survived", "equivalent")
    results = [MR.MutantResult(f"c.py:Op:{n}:0", "c.py", "Op", n, "", s) for n, s in enumerate(statuses)]
    run = MR.MutationRun(tuple(results), C.Attempt(True, "", 1.0, 1), {}, 10.0, 42.0)
    check = R.build(run, "r", (), "c:make", 0.7).checks[0]
    assert mutation.summary(run, check, 0.7) == (
        "mutation score 0.750 (killed / (killed + survived); threshold >= 0.7): PASS; 0.600 with the equivalents "
        "counted as survivors (killed / (killed + survived + equivalent)); killed 3, survived 1, equivalent 1, error "
        "0; wall time 42 s"
    )


def test_a_survivor_of_an_operator_the_fingerprint_cannot_see_is_never_equivalent(tmp_path):
    folder, env = calc_folder(tmp_path / "stack")
    # the guard imports torch: a slack that torch's import fits in
    plan = calc_plan(folder, env, operators=("LowPrecisionRoundTrip",), timeout_slack_s=300.0)
    run = M.execute(plan, tmp_path / "work")
    by = {r.line: r for r in run.results}
    assert set(by) == {6, 7}  # the factor x of `x * 1` and of `x * 2` (ints: the guard passes them through)
    for r in by.values():
        assert r.status == "survived", r
        # the stand-in's fingerprint has no fp32 configuration: a bf16 rounding could not show in it
        assert r.reason.endswith(
            "bitwise the source's fingerprint, which cannot show it: the fingerprint ran no fp32 configuration, "
            "where a bf16 rounding shows"
        ), r.reason
    assert run.counts() == (0, 2, 0)
