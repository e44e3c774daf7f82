"""``lora-suite mutate``: mutation testing of a LoRA stack's own source against the quick tier's fast checks.

    lora-suite mutate --lora-impl MODULE:FACTORY|NAME [--source FILE...] [--workers N] [--min-score F]
                      [--operators NAMES] [--no-fork-server] [--report-dir DIR] [--record [--ledger FILE]]

The options are checked before anything runs (a bad one is a usage error naming it, exit 2); the ``mutate`` extra
must import and a CUDA GPU must be visible (the checks are GPU tests: without one nothing would be judged, and the
command says so and exits 1 instead of reporting a pass). The run itself is ``lora_suite.mutation.mutate``, its report
``lora_suite.mutation.mutation_report``; it prints both scores (the equivalents left out, and counted as survivors).
Exit codes: 0 the score meets ``--min-score``, 1 it does not (or the source fails its checks, or no GPU, or no mutant
was killed or survived: every one judged nothing or is equivalent), 2 bad usage, 3 the mutate extra is missing,
130 interrupted.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
import time
from pathlib import Path

from lora_suite.cli import gpus, targets
from lora_suite.cli.plugins import autoload_plugins
from lora_suite.cli.usage import UsageError

# The quick tier's fast checks that judge a mutant, cheapest first: pytest runs them in this order (after the tests
# that reached the mutant's line, where the source's run traced them) and -x stops at the first failure, so most
# mutants are killed early. A listed file that does not exist is skipped.
FAST_CHECKS = (
    "test_layer_invariants.py",
    "test_layer_properties.py",  # drawn values: inexact scales, biases, NaN/Inf, the merged weight's rounding
    "test_adapter_lifecycle.py",  # state across calls
    "test_layer_probes.py",
    "test_architectures.py",  # biases, fused projections, tied embeddings
    "test_adapter_round_trip.py",
)
EXIT_NO_EXTRA = 3
# What the fork server imports once for every mutant's run (``mutation.forked_runs``): the heavy packages the checks
# import. A package that holds a file under mutation is left out (its children must import the mutant).
PRELOAD = ("torch", "numpy", "safetensors", "transformers", "peft", "pytest")


def default_workers() -> int:
    """One mutant process per two CPU cores, at most 8 (each imports torch and holds a few GiB of the GPU)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def add_parser(sub, help_text: str) -> None:
    m = sub.add_parser("mutate", help=help_text, description=help_text)
    m.add_argument(
        "--lora-impl", dest="lora_impl", help="the stack: package.module:factory, or a known name with --source"
    )
    m.add_argument("--source", nargs="+", metavar="FILE", help="source files to mutate (default: MODULE's file)")
    m.add_argument("--workers", help=f"mutants run at once (default: min(8, CPU cores // 2), here {default_workers()})")
    m.add_argument("--min-score", dest="min_score", help="the score's threshold (default 0.9, the project's target)")
    m.add_argument(
        "--operators",
        help="only these mutation operators, comma-separated (default: all, the value operators of "
        "mutation/lora_value_operators.py included)",
    )
    m.add_argument(
        "--no-fork-server",
        dest="fork_server",
        action="store_false",
        help="start every mutant's run as a fresh Python process (slower: each imports torch and the stack anew)",
    )
    m.add_argument("--report-dir", help="the run goes to DIR/<stamp>-mutate-<impl>/ (default: reports/)")
    m.add_argument("--record", action="store_true", help="append the run's figures to the ledger")
    m.add_argument(
        "--ledger",
        help="the store or .jsonl file --record appends to (default: $LORA_SUITE_STORE, else reports/results.sqlite)",
    )


def tests_dir() -> Path:
    from lora_suite.settings.registry import find_tiers_dir

    root = targets.checkout_root()
    return (root / "tiers" if root else find_tiers_dir()) / "quick"


def fast_checks() -> list[Path]:
    return [p for p in (tests_dir() / name for name in FAST_CHECKS) if p.is_file()]


def checks_command(spec: str, tests: list[Path], report_dir: Path, order: tuple[str, ...] = ()) -> list[str]:
    """pytest on ``tests`` for implementation ``spec``, stopping at the first failure, its report in ``report_dir``;
    with ``order`` (test ids as the run report names them, relative to the root dir), those tests in that order."""
    root = targets.checkout_root()
    cmd = [targets.python(), "-m", "pytest", "-p", "no:cacheprovider", "-x", "-q", "-m", "quick", "--lora-impl", spec]
    cmd += [] if autoload_plugins("quick") else ["-p", "pytest_benchmark.plugin"]  # as the CLI runs quick
    if root:
        cmd += ["--rootdir", str(root)]
    else:
        ini = targets.PACKAGE / "harness" / "pytest-installed.ini"
        cmd += ["-c", str(ini), "--rootdir", str(targets.PACKAGE), "-p", "lora_suite.harness.pytest_plugin"]
    base = root or targets.PACKAGE
    selection = [f"{base}{os.sep}{t}" for t in order] if order else [str(t) for t in tests]  # ids keep their "/"
    return cmd + selection + [f"--report-dir={report_dir}"]


def preloads(plan_targets) -> list[str]:
    """``PRELOAD``'s installed packages that hold none of the files under mutation."""
    out = []
    for name in PRELOAD:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        locations = spec.submodule_search_locations or []
        assert locations or spec.origin is not None  # a found module is a package (its folders) or has its file
        roots = [Path(p).resolve() for p in locations] or [Path(str(spec.origin)).resolve()]
        if not any(t.path == r or r in t.path.parents for t in plan_targets for r in roots):
            out.append(name)
    return out


def _runner(plan_targets, env: dict[str, str], workdir: Path, wanted: bool):
    """A fork server's ``run`` (``mutation.forked_runs``) and how to close it; the ordinary subprocess where it is not
    wanted or refuses to serve (the console says why)."""
    from lora_suite.mutation.forked_runs import ForkServer, ForkServerError, run_subprocess

    if not wanted or not hasattr(os, "fork"):
        print(f"runs: each a fresh process ({'--no-fork-server' if not wanted else 'no os.fork here'})")
        return run_subprocess, lambda: None
    loads = preloads(plan_targets)
    try:
        server = ForkServer(targets.python(), env, loads, [t.module for t in plan_targets], workdir / "fork-server")
    except ForkServerError as exc:
        print(f"runs: each a fresh process: the fork server refused ({exc})")
        return run_subprocess, lambda: None
    print(f"runs: forked from a process that imported {', '.join(loads) or 'nothing'} once")
    return server.run, server.close


def _workers(text: str | None) -> int:
    if text is None:
        return default_workers()
    if not re.fullmatch(r"[1-9][0-9]*", text):
        raise UsageError(f"--workers must be a positive whole number, got {text!r}")
    return int(text)


def _min_score(text: str | None) -> float:
    from lora_suite.mutation.mutation_report import MIN_SCORE

    if text is None:
        return MIN_SCORE
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise UsageError(f"--min-score must be a number from 0 to 1, got {text!r}")
    return value


def _spec(spec: str | None, sources: list[str] | None) -> str:
    """``spec`` checked: MODULE:FACTORY, or a known name (which needs --source: its module is not ours to guess)."""
    if not spec:
        raise UsageError("mutate needs --lora-impl (package.module:factory, or a known name with --source FILE)")
    from lora_suite.settings.implementation_names import SpecError, known_names, parse_spec

    try:
        if parse_spec(spec).is_module:
            return spec
    except SpecError as exc:
        raise UsageError(f"--lora-impl: {exc}") from None
    known = known_names()
    if spec not in known:
        raise UsageError(f"--lora-impl must be package.module:factory or one of {', '.join(known)}; got {spec!r}")
    if not sources:
        raise UsageError(f"--lora-impl {spec}: a named implementation needs --source FILE (the module to mutate)")
    return spec


def _default_source(spec: str) -> Path:
    module = spec.partition(":")[0]
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        raise UsageError(f"--lora-impl {spec}: module {module!r} cannot be found ({exc}); give --source FILE") from None
    if found is None or not found.origin or not found.origin.endswith(".py"):
        raise UsageError(f"--lora-impl {spec}: no Python source for module {module!r} on the path; give --source FILE")
    return Path(found.origin)


def _targets(spec: str, sources: list[str] | None):
    from lora_suite.mutation.mutants import label_of, read_source
    from lora_suite.mutation.mutate import module_of
    from lora_suite.mutation.mutation_run import Target

    paths = [Path(s) for s in sources] if sources else [_default_source(spec)]
    out = []
    for p in paths:
        try:
            read_source(p)
            module = module_of(p, spec.partition(":")[0] if ":" in spec else None)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        out.append(Target(p.resolve(), module, label_of(p)))
    return tuple(out)


def _operators(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    from lora_suite.mutation.mutants import operators

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in operators()]
    if unknown or not names:
        raise UsageError(f"--operators: unknown {unknown or [text]}; known: {', '.join(operators())}")
    return names


def mutate(args) -> int:
    from lora_suite.mutation import mutants

    spec = _spec(args.lora_impl, args.source)
    workers, min_score = _workers(args.workers), _min_score(args.min_score)
    report_root = Path(args.report_dir).resolve() if args.report_dir else targets.default_reports()
    if args.report_dir and not targets.writable_dir(report_root):
        raise UsageError(f"--report-dir {args.report_dir} is not a writable directory")
    try:
        mutants.operators()
    except mutants.MutateUnavailable as exc:
        print(f"lora-suite mutate: {exc}", file=sys.stderr)
        return EXIT_NO_EXTRA
    plan_targets, names = _targets(spec, args.source), _operators(args.operators)
    if gpus.gpu_count() == 0:
        print(
            "lora-suite mutate: needs a CUDA GPU (the checks that judge each mutant are GPU tests): none found; "
            "nothing was judged",
            file=sys.stderr,
        )
        return 1
    tests = fast_checks()
    if not tests:
        print(f"lora-suite mutate: none of {', '.join(FAST_CHECKS)} under {tests_dir()}", file=sys.stderr)
        return 1
    return _run(spec, plan_targets, names, tests, workers, min_score, report_root, args)


def _run(spec, plan_targets, names, tests, workers, min_score, report_root: Path, args) -> int:
    from lora_suite.mutation import mutate as M
    from lora_suite.mutation import mutation_report as R
    from lora_suite.mutation.equivalence import subprocess_fingerprint
    from lora_suite.mutation.mutant_source import fingerprint_command
    from lora_suite.mutation.mutation_run import Plan, score
    from lora_suite.results.ledger import folder_token

    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # no network at run time: local weights only
    env = targets._child_env("quick")
    # each mutant's process gets its share of the CPU cores for torch's threads (16 threads in each of 8 processes
    # would oversubscribe the host); a value the user set is kept
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    workdir = M.scratch_dir()
    runner, close = _runner(plan_targets, env, workdir, getattr(args, "fork_server", True))
    plan = Plan(
        targets=plan_targets,
        command=lambda report_dir, order: checks_command(spec, tests, report_dir, order),
        env=env,
        fingerprint=subprocess_fingerprint(fingerprint_command(targets.python(), spec, "cuda"), runner=runner),
        workers=workers,
        operators=names,
        runner=runner,
    )
    print(f"GPU: {gpus.gpu_line()}  (name, total, used, free, driver)")
    print(f"checks: {', '.join(t.name for t in tests)} (-x); {workers} worker(s)", flush=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    try:
        run = M.execute(plan, workdir)
    except M.BaselineFailed as exc:  # the source's failing run stays in the scratch folder for reading
        print(f"lora-suite mutate: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        shutil.rmtree(workdir, ignore_errors=True)
        print("Interrupted (Ctrl-C): no report written.", file=sys.stderr)
        return 130
    finally:
        close()
    shutil.rmtree(workdir, ignore_errors=True)  # the mutants' files and runs: the report holds every diff and verdict
    run_dir = targets.new_run_dir(report_root, stamp, f"mutate-{folder_token(spec)}")
    report = R.build(run, run_dir.name, plan_targets, spec, min_score)
    md = R.write(run_dir, report, run)
    print("\n" + summary(run, report.checks[0], min_score) + f"; report {md}")
    if args.record:
        print(targets._record(args.ledger or targets.default_ledger(), run_dir))
    if score(*run.counts()[:2]) is None:
        print(f"lora-suite mutate: {nothing_judged(run)}; no score (report {md})", file=sys.stderr)
    return 0 if report.checks[0].passed else 1


def nothing_judged(run) -> str:
    """The line for a run in which no mutant was killed or survived."""
    killed, survived, equivalent = run.counts()
    errors = run.count("error")
    return (
        f"no mutant was killed or survived: {errors} of {len(run.results)} judged nothing (error) and {equivalent} "
        "are equivalent"
    )


def summary(run, check, min_score: float) -> str:
    """The console's line: both scores, the counts, the verdict and the wall time."""
    from lora_suite.mutation.mutation_run import score_counting_equivalents

    killed, survived, equivalent = run.counts()
    honest = score_counting_equivalents(killed, survived, equivalent)
    second = "n/a" if honest is None else f"{honest:.3f}"
    first = "n/a" if check.value != check.value else f"{check.value:.3f}"
    return (
        f"mutation score {first} (killed / (killed + survived); threshold >= {min_score}): "
        f"{'PASS' if check.passed else 'FAIL'}; {second} with the equivalents counted as survivors (killed / (killed "
        f"+ survived + equivalent)); killed {killed}, survived {survived}, equivalent {equivalent}, error "
        f"{run.count('error')}; wall time {run.wall_s:.0f} s"
    )
