"""Running targets: each tier, ``all``, ``bench``, ``selftest`` and ``selftest-gpu`` as a pytest run in its own
folder (``<report root>/<UTC stamp>-<target>[-<impl>]``, made atomically so that two runs never share one), then the
baseline comparison and the ledger record when asked, and a summary table; the offline tools in-process."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import lora_suite
from lora_suite.cli import bytecode, preflight, verdicts
from lora_suite.cli.gpus import gpu_count, gpu_line
from lora_suite.cli.interrupts import Terminated, raise_terminated, run_pytest
from lora_suite.cli.plugins import autoload_plugins
from lora_suite.cli.usage import UsageError
from lora_suite.cli.verdicts import EXIT_NOT_JUDGED, EXIT_USAGE, judged_verdict, require_gpu
from lora_suite.cli.workers import worker_args

PACKAGE = Path(lora_suite.__file__).resolve().parent


def checkout_root() -> Path | None:
    """The repository root when running from a checkout (its pyproject.toml and tests/ beside the package)."""
    root = PACKAGE.parent
    return root if (root / "pyproject.toml").is_file() and (root / "tests").is_dir() else None


def default_reports() -> Path:
    return (checkout_root() or Path.cwd()) / "reports"


def default_ledger() -> str | Path:
    """Where runs are recorded: ``$LORA_SUITE_STORE`` (a team's server URL), else the embedded store in reports/."""
    return os.environ.get("LORA_SUITE_STORE") or default_reports() / "results.sqlite"


def ledger_sources(explicit: str | None) -> list[str | Path]:
    """What is read when no ledger is named: the store, then the published ledger (the rows the docs cite)."""
    published = default_reports() / "ledger.jsonl.gz"
    return [explicit] if explicit else [default_ledger(), *([published] if published.is_file() else [])]


def python() -> str:
    """The interpreter of the runs: $PYTHON where set (gpu-test.sh passes the one it chose), else this one."""
    return os.environ.get("PYTHON") or sys.executable


def new_run_dir(root: Path, stamp: str, name: str) -> Path:
    """``root/<stamp>-<name>``, or ``-2``, ``-3``...: mkdir is atomic, so runs started in one second never share."""
    root.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        d = root / (f"{stamp}-{name}" if n == 1 else f"{stamp}-{name}-{n}")
        try:
            d.mkdir()
            return d
        except FileExistsError:
            n += 1


def writable_dir(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
        return True
    except OSError:
        return False


def pytest_args(target: str, args, run_dir: Path | None, tiers: dict) -> list[str]:
    """The pytest command line of one target."""
    from lora_suite.settings.registry import find_tiers_dir

    root = checkout_root()
    base = [python(), "-m", "pytest", "-p", "no:cacheprovider"]
    if not autoload_plugins(target):
        base += ["-p", "pytest_benchmark.plugin"]
    base += (
        ["--rootdir", str(root)]
        if root
        else [
            "-c",
            str(PACKAGE / "harness" / "pytest-installed.ini"),
            "--rootdir",
            str(PACKAGE),
            "-p",
            "lora_suite.harness.pytest_plugin",
        ]
    )
    if getattr(args, "verbose", False):
        base += ["-v", "-o", "log_cli=true", "--log-cli-level=INFO"]
    for flag, value in (
        ("--lora-impl", args.lora_impl),
        ("--weights", getattr(args, "weights", None)),
        ("--gpus", getattr(args, "gpus", None)),
        ("--nodes", getattr(args, "nodes", None)),
        ("--node-rank", getattr(args, "node_rank", None)),
        ("--rdzv-endpoint", getattr(args, "rdzv_endpoint", None)),
        ("--shared-dir", getattr(args, "shared_dir", None)),
        ("--fused-ops", getattr(args, "fused_ops", None)),
        ("--vram-limit", getattr(args, "vram_limit", None)),
    ):
        if value is not None:
            base += [flag, str(value)]
    report = [f"--report-dir={run_dir}", f"--junitxml={run_dir / 'junit.xml'}"] if run_dir else []
    tiers_dir = root / "tiers" if root else find_tiers_dir()
    if target == "selftest":
        assert root is not None, "run_targets refuses selftest outside a checkout"
        return base + [str(root / "tests")]
    if target == "bench":
        assert run_dir is not None, "bench writes its benchmark.json into its run folder"
        bench = root / "benchmarks" if root else PACKAGE / "benchmarks"
        return base + [str(bench), "-m", "benchmark", f"--benchmark-json={run_dir / 'benchmark.json'}"] + report
    if target == "selftest-gpu":
        return base + [str(tiers_dir), "-m", "selftest_gpu"] + report
    t = tiers[target]
    out = base + [str(t.tests_dir if not root else tiers_dir / t.tests_dir.name), "-m", t.marker] + report
    out += worker_args(target, getattr(args, "workers", None))
    flags = {"--check-vram": args.check_vram, "--strict-vram": args.strict_vram, "--oom-retry": args.oom_retry}
    return out + [flag for flag, on in flags.items() if on]


def run_targets(args, extra: list[str]) -> int:
    from lora_suite.settings.registry import registry

    tiers = registry()
    target = args.target
    preflight.check_run_options(args, target, tiers)
    if target == "selftest" and checkout_root() is None:
        raise UsageError("selftest runs the CPU tests of a checkout (tests/ is not installed with the package)")
    report_root = Path(args.report_dir).resolve() if args.report_dir else default_reports()
    if args.report_dir and not writable_dir(report_root):  # before anything runs, not after a tier ran for minutes
        raise UsageError(f"--report-dir {args.report_dir} is not a writable directory")
    names = [target]
    if target == "all":
        names, found = [n for n, t in tiers.items() if t.entry.in_all and t.entry.gpus <= 1], gpu_count()
        for n, t in tiers.items():
            if t.entry.in_all and t.entry.gpus > 1:
                if found >= t.entry.gpus:
                    names.append(n)
                else:
                    print(f"{n}: not part of this 'all' run (it needs {t.entry.gpus} or more GPUs; found {found})")
    if os.environ.get("GPU_TEST_DRY_RUN") == "1":  # the CPU tests of target selection
        print(f"targets: {' '.join(names)}")
        return 0
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # progress lines appear as they happen in CI logs
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # no network at run time: local weights only
    if target != "selftest" and require_gpu(args) and not gpu_line():  # before the "will be skipped" lines
        print(verdicts.no_gpu_found(args, target), file=sys.stderr)
        return EXIT_NOT_JUDGED
    have_gpu = target == "selftest" or _announce_gpu(target)
    return _run(names, args, extra, tiers, report_root, have_gpu)


def _announce_gpu(target: str) -> bool:
    line = gpu_line()
    if line:
        print(f"GPU: {line}  (name, total, used, free, driver)")
        return True
    print("No NVIDIA GPU found (no nvidia-smi / NVML device).")
    print(f"The GPU tests of '{target}' will be skipped with that reason (the CPU self-tests are 'selftest').")
    return False


def _baseline(args) -> Path | None:
    """The baseline folder ``--baseline`` names (auto: ``reports/baselines/<this GPU>``), or None."""
    from lora_suite.results.ledger import folder_token

    if args.baseline == "auto":
        gpu = (gpu_line() or "none").split(",")[0]
        return (checkout_root() or Path.cwd()) / "reports" / "baselines" / folder_token(gpu).rstrip("_")
    return Path(args.baseline) if args.baseline else None


def _against_baseline(t: str, baseline: Path, run_dir: Path, rc: int) -> int:
    """The target's code after ``compare`` with its baseline: 6 on a regression, 2 when compare refused the pair."""
    from lora_suite.results import compare

    found = (baseline / t, baseline)
    base = next((d for d in found if (d / "report.json").is_file() or (d / "benchmark.json").is_file()), None)
    if base is None:
        print(f"no baseline for {t} under {baseline}: not compared")
        return rc
    print(f"--- {t} vs baseline {base} ---", flush=True)
    crc = compare.main([str(base), str(run_dir)])
    return 6 if crc == 1 else (2 if crc == 2 and rc == 0 else rc)


def _run_one(t: str, args, extra, tiers, run_dir: Path | None, have_gpu: bool, setup: float | None, baseline):
    """One target: its pytest, its baseline comparison and ledger record; (summary row, exit code, stopped by)."""
    cmd = pytest_args(t, args, run_dir, tiers) + extra
    print(f"\n=== {t} ===  {' '.join(cmd)}", flush=True)
    start, env = time.time(), _child_env(t)
    if setup is not None:  # this interpreter's first GPU run here: the report's wall-time breakdown names it
        env[bytecode.SETUP_ENV] = f"{setup:.2f}"
    if run_dir is not None:  # the report's run id is its folder's name: `ledger show --run <folder>` finds it
        env["LORA_SUITE_RUN_ID"] = run_dir.name
    rc, stopped = run_pytest(cmd, env)
    if baseline and run_dir and not stopped:
        rc = _against_baseline(t, baseline, run_dir, rc)
    if args.record and run_dir and not stopped and (run_dir / "report.json").is_file():
        print(_record(args.ledger or default_ledger(), run_dir))
    verdict, rc = judged_verdict(run_dir, rc, have_gpu)  # nothing judged is never PASS
    if rc == EXIT_USAGE and run_dir and not any(run_dir.iterdir()):  # refused before it ran: no empty folder
        run_dir.rmdir()
        run_dir = None
    return f"{t:<12} {stopped or verdict:<30} {int(time.time() - start):>6}s  {run_dir or '-'}", rc, stopped


def _run(names, args, extra, tiers, report_root: Path, have_gpu: bool) -> int:
    from lora_suite.results.ledger import folder_token

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    impl = folder_token(args.lora_impl) if args.lora_impl else ""
    rows, codes, stopped, baseline = [], [], None, _baseline(args)
    term = signal.signal(signal.SIGTERM, raise_terminated)  # also between targets: the summary of what ran
    try:
        setup = (
            bytecode.compile_packages(python(), _child_env(names[0])) if have_gpu and names != ["selftest"] else None
        )
        for t in names:
            suffix = f"-{impl}" if impl and t not in ("selftest-gpu",) else ""
            run_dir = None if t == "selftest" else new_run_dir(report_root, stamp, t + suffix)
            row, rc, stopped = _run_one(t, args, extra, tiers, run_dir, have_gpu, setup, baseline)
            rows.append(row)
            codes.append(rc)
            setup = None
            if stopped:
                break
            if rc not in (0, EXIT_NOT_JUDGED) and not args.continue_on_error and len(names) > 1:
                # a capacity verdict, and the GPU was released: the rest still run
                if verdicts.ran_out_of_memory(run_dir):
                    print(f"{t} ran out of memory (its report says where and what would fit); the next targets run.")
                    continue
                print(f"{t} failed; stopping (use --continue-on-error to run the rest).")
                break
    except Terminated:  # outside a pytest run (the set-up, a comparison, a record): no traceback, the summary
        stopped = "TERMINATED"
    finally:
        signal.signal(signal.SIGTERM, term)
    print("\nSummary" + (" (no GPU: GPU tests were skipped)" if not have_gpu else ""))
    print(f"{'target':<12} {'result':<30} {'time':>7}  report")
    print("\n".join(rows))
    if stopped:
        print(
            f"{stopped.capitalize()} ({'SIGTERM' if stopped == 'TERMINATED' else 'Ctrl-C'}): the targets after it did not run."
        )
        return 143 if stopped == "TERMINATED" else 130
    if EXIT_USAGE in codes:
        return EXIT_USAGE
    return (
        1 if any(c not in (0, EXIT_NOT_JUDGED) for c in codes) else (EXIT_NOT_JUDGED if EXIT_NOT_JUDGED in codes else 0)
    )


def _record(path: str | Path, run_dir: Path) -> str:
    """Append a finished run's rows to the ledger; a run that saw no GPU judged nothing there and is not recorded."""
    import json

    from lora_suite.results import ledger

    if why := ledger.refusal(json.loads((run_dir / "report.json").read_text())):
        return f"ledger: {run_dir.name} not recorded: {why}"
    from lora_suite.results.store import redacted

    try:
        added = ledger.record(path, [run_dir], group=run_dir.parent.name)
    except ledger.LedgerError as exc:  # the run stands; only its recording failed, and says why
        return f"ledger: {run_dir.name} not recorded: {exc}"
    return f"ledger: {added} row(s) of {run_dir.name} appended to {redacted(path)}"


def _child_env(target: str = "selftest") -> dict[str, str]:
    env = bytecode.child_env(dict(os.environ))  # bytecode cached where the interpreter was told to write none
    if not autoload_plugins(target):
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    root = checkout_root()
    if root:  # a checkout's package wins over an installed copy in the runs too
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return env
