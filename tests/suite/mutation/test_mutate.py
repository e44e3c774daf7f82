"""``lora-suite mutate`` on the CPU (``lora_suite.mutation.mutate``, ``mutation_report``, ``engine.fingerprint``,
``core.mutant_source``, ``cli.mutation``): mutants classified by a stand-in for the quick tier's checks (a tiny
torch-free stack, and the example's layer through the probe checks on the CPU), the score, the fingerprint's
equivalence rule, the report and its ledger rows, a failing source, the command line's refusals."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("cosmic_ray", reason="the mutate extra (cosmic-ray) is not installed")

from lora_suite.mutation import check_run as CR  # noqa: E402
from lora_suite.mutation import equivalence as EQ  # noqa: E402
from lora_suite.mutation import mutant_source  # noqa: E402
from lora_suite.mutation import mutate as M  # noqa: E402
from lora_suite.mutation import mutation_report as R  # noqa: E402
from lora_suite.mutation import mutation_run as MR  # noqa: E402
from tests.suite.mutation.mutation_standins import CALC, CHECKS, calc_folder, calc_plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def calc_stack(tmp_path):
    return calc_folder(tmp_path)


def test_each_mutant_is_killed_survives_or_is_equivalent_for_its_reason(calc_stack, tmp_path):
    folder, env = calc_stack
    run = M.execute(calc_plan(folder, env), tmp_path / "work")
    by = {(r.line, r.operator): r for r in run.results}
    assert len(run.results) == 10
    assert by[(2, "DeleteStatement")].killed_by == "check 'scale(8, 4) is 2' (check_calc.py::test_scale)"
    assert by[(11, "DeleteStatement")].killed_by == "check_calc.py::test_shifted: NameError: name 'k' is not defined"
    assert (
        by[(18, "DeleteStatement")].killed_by.startswith("timeout")
        and "run alone" in by[(18, "DeleteStatement")].killed_by
    )
    survivor = by[(7, "ReplaceBinaryOperator_Mul_Div")]
    assert survivor.status == "survived" and "-    return x * 2\n+    return x / 2\n" in survivor.diff
    assert survivor.reason == "changes double(0), double(3); no check saw it"
    assert by[(6, "DeleteStatement")].status == "equivalent"  # `unused = x * 1` deleted: nothing changes
    assert by[(6, "ReplaceBinaryOperator_Mul_Div")].status == "equivalent"
    assert (run.count("killed"), run.count("survived"), run.count("equivalent")) == (7, 1, 2)
    assert all(r.seconds > 0 for r in run.results if r.status != "equivalent")


def test_a_mutant_on_a_line_neither_the_checks_nor_the_fingerprint_run_survives_unrun(calc_stack, tmp_path):
    folder, env = calc_stack
    (folder / "calc.py").write_text(CALC + "\n\ndef rarely(x):\n    if x > 100:\n        return x * 3\n    return x\n")
    (folder / "check_calc.py").write_text(
        CHECKS.replace(
            '    "check_calc.py::test_count"',
            '    "check_calc.py::test_rarely": ("rarely(1) is 1", lambda: calc.rarely(1) == 1),\n    "check_calc.py::test_count"',
        )
    )
    run = M.execute(calc_plan(folder, env, operators=("ReplaceBinaryOperator_Mul_Div",)), tmp_path / "work")
    by = {r.line: r for r in run.results}
    skipped = by[24]  # `return x * 3`: never reached by rarely(1), nor by the fingerprint (it calls double only)
    never = "the fingerprint never runs line 24 either: its sameness proves nothing"
    if sys.version_info >= (3, 12):  # the trace sees every thread: the mutant is not run
        assert skipped.status == "survived" and skipped.seconds == 0.0, skipped
        assert skipped.reason == f"not run: the checks never execute line 24; {never}"
    else:  # settrace may miss threads Python did not start: every mutant runs
        assert skipped.status == "survived" and skipped.seconds > 0, skipped
        assert skipped.reason == never
    assert by[7].status == "survived" and by[7].seconds > 0  # x * 2 runs: its mutant ran the checks


@pytest.mark.parametrize("every_thread", [True, False])
def test_only_a_trace_that_saw_every_thread_lets_mutants_go_unrun(calc_stack, tmp_path, every_thread):
    folder, env = calc_stack
    plan = calc_plan(folder, env, operators=("ReplaceBinaryOperator_Mul_Div",))
    from lora_suite.mutation.mutants import mutants_of, read_source

    target = plan.targets[0]
    mutants = [(target, m) for m in mutants_of(read_source(target.path), target.label, plan.operators)]
    ran = [2, 7, 8, 12, 13, 17, 18, 19]  # every line but 6 (`unused = x * 1`)
    trace = {"every_thread": every_thread, "lines": {str(target.path.resolve()): ran}}
    not_run = {mutants[n][1].line for n in M._not_run(plan, mutants, trace, M._starts(plan.targets))}
    assert not_run == ({6} if every_thread else set())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork servers need os.fork (POSIX)")
def test_runs_forked_from_a_fork_server_give_the_same_verdicts(calc_stack, tmp_path):
    from lora_suite.mutation.forked_runs import ForkServer

    folder, env = calc_stack
    fresh = M.execute(calc_plan(folder, env), tmp_path / "fresh")
    server = ForkServer(sys.executable, env, ["json"], ["calc"], tmp_path / "fs")
    try:
        plan = calc_plan(
            folder,
            env,
            command=lambda report, order: [sys.executable, "-m", "check_calc", str(report), *order],
            fingerprint=EQ.subprocess_fingerprint([sys.executable, "-m", "fingerprint_calc"], runner=server.run),
            runner=server.run,
        )
        forked = M.execute(plan, tmp_path / "forked")
    finally:
        server.close()
    assert forked.counts() == fresh.counts() == (7, 1, 2)

    def verdicts(run):  # a timeout's seconds come from the source's own time, which differs between the two runs
        return [(r.id, r.status, r.killed_by.split(" (over")[0], r.reason) for r in run.results]

    assert verdicts(forked) == verdicts(fresh)


def test_a_mutant_runs_the_tests_that_reach_its_line_first_and_every_test_where_it_survives(calc_stack, tmp_path):
    folder, env = calc_stack
    run = M.execute(calc_plan(folder, env), tmp_path / "work")
    ran = {}
    for n, r in enumerate(run.results):
        report = tmp_path / "work" / f"mutant-{n:04d}" / "report" / "report.json"
        if report.is_file():
            ran[(r.line, r.operator)] = [o["test"].split("::")[1] for o in json.loads(report.read_text())["outcomes"]]
    assert ran[(12, "DeleteStatement")] == ["test_shifted"]  # `k = 1` deleted: killed by the first test it runs
    assert ran[(7, "ReplaceBinaryOperator_Mul_Div")] == ["test_double", "test_scale", "test_shifted", "test_count"]
    assert ran[(2, "DeleteStatement")] == ["test_scale"]


def test_a_failing_source_stops_the_run_before_any_mutant(calc_stack, tmp_path):
    folder, env = calc_stack
    (folder / "calc.py").write_text(CALC.replace("alpha / r", "alpha * r"))
    with pytest.raises(M.BaselineFailed, match="unmutated source does not pass the checks .check 'scale"):
        M.execute(calc_plan(folder, env), tmp_path / "work")
    assert not list((tmp_path / "work").glob("mutant-*"))


def test_a_source_whose_checks_judge_nothing_stops_the_run(calc_stack, tmp_path):
    folder, env = calc_stack
    nothing = folder / "nothing.py"
    nothing.write_text("import sys\n")  # exits 0, writes no report: every GPU test skipped
    with pytest.raises(M.BaselineFailed, match="judged nothing"):
        M.execute(
            calc_plan(folder, env, command=lambda report, order: [sys.executable, str(nothing)]), tmp_path / "work"
        )


@pytest.mark.parametrize(
    "killed, survived, expected", [(9, 1, 0.9), (0, 3, 0.0), (3, 0, 1.0), (7, 1, 0.875), (0, 0, None)]
)
def test_the_score_leaves_the_equivalent_mutants_out(killed, survived, expected):
    assert MR.score(killed, survived) == expected


def test_the_score_refuses_negative_counts():
    with pytest.raises(ValueError, match="killed=-1"):
        MR.score(-1, 2)


def _run(results, wall=12.0) -> MR.MutationRun:
    baseline = {"implementation": {"name": "calc", "spec": "calc:make", "description": "", "not_applicable": {}}}
    return MR.MutationRun(tuple(results), CR.Attempt(True, "", 1.5, 1), baseline, 34.5, wall)


def _result(n, status, **kw):
    return MR.MutantResult(f"calc.py:Op:{n}:0", "calc.py", "Op", n, f"-a{n}\n+b{n}\n", status, **kw)


RESULTS = [
    _result(1, "killed", killed_by="check 'scale' (t.py::test)"),
    _result(2, "killed", killed_by="t.py::test: NameError: k"),
    _result(3, "survived", reason="changes fp32: init; no check saw it"),
    _result(4, "equivalent", reason="bitwise the source's fingerprint"),
    _result(5, "error", reason="no report.json: the harness did not run (exit 4: ImportError: lora_suite)"),
]


def test_the_report_gives_the_score_first_then_survivors_with_diffs_and_its_ledger_rows(tmp_path):
    import jsonschema

    from lora_suite.results import ledger

    run = _run(RESULTS)
    targets = (MR.Target(tmp_path / "calc.py", "calc", "calc.py"),)
    report = R.build(run, "20260101T000000Z-mutate-calc", targets, "calc:make", 0.9)
    md = R.write(tmp_path, report, run).read_text()
    data = json.loads((tmp_path / "report.json").read_text())
    jsonschema.validate(data, json.loads((ROOT / "reports/schema/report-v5.schema.json").read_text()))
    assert data["checks"][0]["name"] == R.SCORE_CHECK and data["checks"][0]["value"] == pytest.approx(2 / 3, abs=1e-4)
    assert data["checks"][0]["passed"] is False and data["checks"][0]["threshold"] == 0.9
    mutants = next(s for s in data["series"] if s["name"] == "mutants")
    assert [r[4] for r in mutants["rows"]] == ["killed", "killed", "survived", "equivalent", "error"]
    assert R.figures(data) == {
        R.SCORE_CHECK: pytest.approx(0.6667),
        "mutants killed": 2,
        "mutants survived": 1,
        "mutants equivalent": 1,
        "mutants error": 1,
        R.HONEST: 0.5,  # 2 / (2 + 1 + 1): the equivalent counted as a survivor; the error in neither score
        "wall s": 12.0,
    }
    first = md.splitlines()[2]
    assert first.startswith("**Mutation score 0.667** (killed 2 / (killed 2 + survived 1))") and "FAIL" in first
    assert md.splitlines()[4].startswith(
        "**With the equivalents counted as survivors: 0.500** (killed 2 / (killed 2 + survived 1 + equivalent 1))"
    )
    assert "1 equivalent (left out of the first score), 1 error (judged nothing: in neither score)" in md
    assert "## Errors (the run judged nothing: in neither score)\n\n- `calc.py:Op:5:0`: no report.json" in md
    assert "| Op | 2 | 1 | 1 | 1 |" in md
    assert "### `calc.py:Op:3:0`\n\nWhy it survives: changes fp32: init; no check saw it\n\n```diff\n-a3\n+b3" in md
    assert "| check 'scale' | 1 |" in md and "| crash: NameError | 1 |" in md
    rows = ledger.rows_of_report(data, data["run_id"], "g")
    got = {r["check"]: (r["kind"], r["value"], r["verdict"]) for r in rows}
    assert got[R.SCORE_CHECK] == ("check", pytest.approx(0.6667), "fail")
    assert got["mutation testing: calc: mutants survived"] == ("bench", 1, "measured")
    assert got["mutation testing: calc: wall s"] == ("bench", 12.0, "measured")
    assert got[f"mutation testing: calc: {R.HONEST}"] == ("bench", 0.5, "measured")
    assert got["mutation testing: calc: mutants error"] == ("bench", 1, "measured")
    assert rows[0]["tier"] == "mutate" and rows[0]["verdict"] == "fail"


def test_a_score_at_the_threshold_passes(tmp_path):
    run = _run([_result(n, "killed", killed_by="timeout (over 9 s)") for n in range(9)] + RESULTS[2:3])
    report = R.build(run, "r", (), "calc:make", 0.9)
    assert report.checks[0].passed and report.checks[0].value == 0.9


def test_the_report_files_are_written_atomically(tmp_path, monkeypatch):
    run = _run(RESULTS)
    report = R.build(run, "r", (), "calc:make", 0.9)
    R.write(tmp_path, report, run)
    before = (tmp_path / "report.json").read_text()
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        R.write(tmp_path, R.build(_run(RESULTS[:1]), "r2", (), "calc:make", 0.9), _run(RESULTS[:1]))
    assert (tmp_path / "report.json").read_text() == before  # the old report whole, no half-written one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.md"]


def test_a_mutant_replaces_its_module_wherever_it_is_imported(tmp_path, monkeypatch):
    pkg = tmp_path / "stackpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from stackpkg.layer import VALUE\n")
    (pkg / "layer.py").write_text("VALUE = 'original'\n")
    mutant = tmp_path / "mutant" / "layer.py"
    mutant.parent.mkdir()
    mutant.write_text("VALUE = 'mutant'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    env = mutant_source.mutant_env("stackpkg.layer", mutant)
    mutant_source.install_from_env(env)
    try:
        import stackpkg

        assert stackpkg.VALUE == "mutant" and sys.modules["stackpkg.layer"].__file__ == str(mutant)
        with pytest.raises(mutant_source.MutantError, match="imported before its mutant"):
            mutant_source.install("stackpkg", mutant)
    finally:
        for name in ("stackpkg", "stackpkg.layer"):
            sys.modules.pop(name, None)
    with pytest.raises(mutant_source.MutantError, match="go together"):
        mutant_source.install_from_env({mutant_source.MODULE_ENV: "x"})
    assert mutant_source.install_from_env({}) is None


def test_the_module_of_a_source_is_found_on_the_path():
    examples = str(ROOT / "examples")
    assert M.module_of(ROOT / "examples/plain_lora.py", "plain_lora", [str(ROOT), examples]) == "plain_lora"
    peft_impl = ROOT / "lora_suite/implementations/peft_impl.py"
    assert M.module_of(peft_impl, None, [str(ROOT), examples]) == "lora_suite.implementations.peft_impl"
    with pytest.raises(ValueError, match="not importable from the Python path"):
        M.module_of(peft_impl, None, [examples])


# --- the example's layer through the probe checks on the CPU -------------------------------------------------

LAYER_CHECKS = """\
import json, sys
from pathlib import Path

from lora_suite.mutation.mutant_source import install_from_env

install_from_env()
import torch
from lora_suite.engine import probes as P
from lora_suite.judges import layer_checks as L, probe_judge as PJ
from lora_suite.implementations import AdapterSpec, resolve_implementation

shape = P.BlockShape("tiny", 48, 40, 16, 76)
impl = resolve_implementation("plain_lora:make")
spec = AdapterSpec(P.PROBE_TARGETS, 4, 8.0, adapter_dtype=torch.float32)
probe = P.build_probe(impl, shape, spec, torch.float32, "cpu")
inputs = P.random_inputs(shape, (2, 5), torch.float32, "cpu")
got, errs = L.parity_errors(probe, inputs)
verdicts = L.parity_verdicts("cpu", [("tiny", errs, PJ.dtype_errors(probe, inputs, got))]) + [L.merged(probe, inputs)]
test = "layer_checks_cpu.py::test_probe"
checks = [{"test": test, "name": v.name, "passed": v.passed} for v in verdicts]
ok = all(c["passed"] for c in checks)
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
(out / "report.json").write_text(json.dumps({"checks": checks, "outcomes": [{"test": test, "outcome": "passed" if ok else "failed"}]}))
"""


def test_a_mutant_of_the_example_is_killed_by_the_probe_check_it_breaks(tmp_path):
    script = tmp_path / "layer_checks_cpu.py"
    script.write_text(LAYER_CHECKS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "examples"), str(ROOT)]))
    source = ROOT / "examples" / "plain_lora.py"
    plan = MR.Plan(
        targets=(MR.Target(source, "plain_lora", "examples/plain_lora.py"),),
        command=lambda report, order: [sys.executable, str(script), str(report)],
        env=env,
        fingerprint=lambda env: {},
        workers=2,
        operators=("ReplaceBinaryOperator_Add_Sub",),
        log=lambda line: None,
    )
    run = M.execute(plan, tmp_path / "work")
    killed = {r.line: r.killed_by for r in run.results}
    forward = next(i for i, ln in enumerate(source.read_text().splitlines(), 1) if "return self.base(x) +" in ln)
    assert killed[forward].startswith("check 'cpu: outputs beyond tolerance")
    assert [k for line, k in killed.items() if line != forward] == [
        "check 'merged weights: outputs beyond tolerance (of 5)' (layer_checks_cpu.py::test_probe)"
    ]


def _example_variant(tmp_path, name: str, old: str, new: str):
    """The example with ``old`` replaced by ``new``, loaded as a module of its own; its implementation."""
    import importlib.util

    text = (ROOT / "examples" / "plain_lora.py").read_text()
    assert old in text
    path = tmp_path / f"{name}.py"
    path.write_text(text.replace(old, new))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make()


def test_the_fingerprint_tells_an_equivalent_mutant_from_one_that_changes_something(tmp_path):
    pytest.importorskip("safetensors")
    from lora_suite.engine import fingerprint as FP

    source = FP.fingerprint(_example_variant(tmp_path, "fp_source", "x", "x"), "cpu")
    assert FP.fingerprint(_example_variant(tmp_path, "fp_source_again", "x", "x"), "cpu") == source
    assert not any(v.startswith("raised") for v in source.values()), source
    # the same function written another way: bitwise the same everything
    same = _example_variant(tmp_path, "fp_same", "self.calls += 1", "self.calls = self.calls + 1")
    assert FP.differing(FP.fingerprint(same, "cpu"), source) == []
    # another init (kaiming's a): the checks randomise the adapters, the fingerprint's init part does not
    init = _example_variant(tmp_path, "fp_init", "a=math.sqrt(5)", "a=5")
    assert FP.differing(FP.fingerprint(init, "cpu"), source) == [
        "bfloat16: init",
        "float32+bias: init",
        "float32+rslora: init",
        "float32: init",
    ]
    # the base's bias dropped: only the configuration whose base layers carry one tells it apart
    nobias = _example_variant(tmp_path, "fp_nobias", "self.base(x) +", "F.linear(x, self.base.weight) +")
    assert FP.differing(FP.fingerprint(nobias, "cpu"), source) == [
        "float32+bias: forward+backward",
        "float32+bias: loaded",
    ]  # (its merge hands back the base layer, bias and all)
    # rsLoRA's scale: only the rsLoRA configuration tells it apart
    rs = _example_variant(tmp_path, "fp_rs", "math.sqrt(r) if use_rslora", "r if use_rslora")
    assert FP.differing(FP.fingerprint(rs, "cpu"), source) == [
        "float32+rslora: forward+backward",
        "float32+rslora: loaded",
        "float32+rslora: merged",
    ]
    # the scale rounded through bf16 (LowPrecisionRoundTrip's class): 7/3 is exact in no format, so every fp32
    # configuration tells it apart, and the bf16 one (whose adapters are bf16 anyway) does not
    scale = "alpha / (math.sqrt(r) if use_rslora else r)"
    rounded = _example_variant(tmp_path, "fp_rounded", scale, f"float(torch.tensor({scale}).bfloat16())")
    assert {p.split(":")[0] for p in FP.differing(FP.fingerprint(rounded, "cpu"), source)} >= {"float32"}
    # a save that raises: the exception is part of the fingerprint
    broken = _example_variant(tmp_path, "fp_broken", "path.mkdir(parents=True, exist_ok=True)", "pass")
    diff = FP.differing(FP.fingerprint(broken, "cpu"), source)
    assert "float32: saved folder" in diff and "float32: loaded" in diff


def test_the_command_refuses_bad_input_and_a_machine_without_a_gpu(tmp_path, capsys, monkeypatch):
    from lora_suite.cli import main

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    cases = {
        ("--lora-impl", "nope"): "--lora-impl must be package.module:factory or one of",
        ("--lora-impl", "peft"): "--lora-impl peft: a named implementation needs --source FILE",
        ("--lora-impl", "plain_lora:make", "--source", str(tmp_path / "absent.py")): "absent.py: no such file",
        ("--lora-impl", "plain_lora:make", "--source", str(bad)): "bad.py: does not parse as Python",
        ("--lora-impl", "plain_lora:make", "--workers", "0"): "--workers must be a positive whole number, got '0'",
        ("--lora-impl", "plain_lora:make", "--min-score", "1.5"): "--min-score must be a number from 0 to 1",
    }
    for argv, message in cases.items():
        assert main(["mutate", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err.splitlines()[0], (argv, err)
    monkeypatch.setenv("GPU_TEST_GPU_COUNT", "0")
    assert main(["mutate", "--lora-impl", "plain_lora:make"]) == 1
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "nothing was judged" in err


def test_the_command_names_the_missing_extra(monkeypatch, capsys):
    from lora_suite.cli import main
    from lora_suite.mutation import mutants

    def missing():
        raise mutants.MutateUnavailable(
            f"mutation testing needs the mutate extra (no cosmic_ray): {mutants.EXTRA_HINT}"
        )

    monkeypatch.setattr(mutants, "operators", missing)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    assert main(["mutate", "--lora-impl", "plain_lora:make"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lora-gpu-suite[mutate]" in err


def test_the_fast_checks_run_cheapest_first_and_stop_at_the_first_failure(tmp_path):
    from lora_suite.cli import mutation

    assert mutation.FAST_CHECKS[-1] == "test_adapter_round_trip.py"  # the one that builds models, last
    cmd = mutation.checks_command("plain_lora:make", [Path("a.py"), Path("b.py")], tmp_path)
    assert cmd[cmd.index("--lora-impl") + 1] == "plain_lora:make" and "-x" in cmd
    assert cmd[cmd.index("quick") - 1] == "-m"
    assert cmd[-3:] == ["a.py", "b.py", f"--report-dir={tmp_path}"]
    ids = ("tiers/quick/b.py::test_x[fp32/2d]", "tiers/quick/a.py::test_y")  # a mutant's order: run as given
    cmd = mutation.checks_command("plain_lora:make", [Path("a.py"), Path("b.py")], tmp_path, ids)
    root = cmd[cmd.index("--rootdir") + 1]
    assert cmd[-3:] == [f"{root}{os.sep}{ids[0]}", f"{root}{os.sep}{ids[1]}", f"--report-dir={tmp_path}"]
    assert all(p.is_file() for p in mutation.fast_checks())


def test_the_fork_server_preloads_no_package_that_holds_a_file_under_mutation():
    from lora_suite.cli import mutation

    inside = MR.Target(Path(pytest.__file__).resolve(), "pytest", "pytest/__init__.py")
    elsewhere = MR.Target(ROOT / "examples" / "plain_lora.py", "plain_lora", "examples/plain_lora.py")
    assert "pytest" in mutation.preloads((elsewhere,)) and "torch" in mutation.preloads((elsewhere,))
    assert "pytest" not in mutation.preloads((inside,)) and "torch" in mutation.preloads((inside,))
