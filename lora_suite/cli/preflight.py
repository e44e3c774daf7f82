"""The user's mistakes, answered before anything runs: a broken tier YAML, an implementation that cannot be found,
an option the target does not take, a path that is not there. Each is a ``UsageError`` (one line naming the file,
key or option and what would be valid; exit 2), raised before pytest starts, so that no mistake ends in a traceback,
a pytest ``INTERNALERROR`` or an empty run folder.

What is checked here without importing the implementation (the command line imports no torch): a
``package.module:factory`` whose module cannot be found, and a bare name that is neither built in, bundled nor an
entry point. A module that is found but raises when imported is named by the plugin (``lookup.resolve_implementation``)
as a pytest usage error, which the run's summary reads as USAGE ERROR with exit 2.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from lora_suite.cli.usage import UsageError
from lora_suite.settings.implementation_names import SpecError, known_names, parse_spec

GPUS_TARGETS = ("multigpu", "all")  # the targets that start torchrun jobs
# options of some targets only: not offered (nor listed by --help) on the others, and refused there by name
ONLY_FOR = {
    "--gpus": GPUS_TARGETS,
    "--nodes": ("multinode",),
    "--node-rank": ("multinode",),
    "--rdzv-endpoint": ("multinode",),
    "--shared-dir": ("multinode",),
}


def check_multinode_options(target: str, args) -> None:
    """The multinode options go to the multinode tier only, and across hosts (``--rdzv-endpoint``) together: the
    node this host runs and a folder every node sees."""
    given = [f for f, d in (("--nodes", "nodes"), ("--node-rank", "node_rank"), ("--rdzv-endpoint", "rdzv_endpoint"),
                            ("--shared-dir", "shared_dir")) if getattr(args, d, None) is not None]  # fmt: skip
    if given and target != "multinode":
        raise UsageError(f"{', '.join(given)}: for the multinode tier (lora-suite multinode), not for {target!r}")
    if getattr(args, "rdzv_endpoint", None) is None:
        if getattr(args, "node_rank", None) is not None or getattr(args, "shared_dir", None) is not None:
            raise UsageError(
                "--node-rank and --shared-dir run one node of a job that spans hosts: give --rdzv-endpoint HOST:PORT "
                "(node 0's address) too, or leave all three out to run every node on this host"
            )
        return
    nodes = getattr(args, "nodes", None) or 2
    rank = getattr(args, "node_rank", None)
    if rank is None or not 0 <= rank < nodes:
        raise UsageError(f"--node-rank {rank}: with --rdzv-endpoint, expected this host's node, 0 to {nodes - 1}")
    if getattr(args, "shared_dir", None) is None or not Path(args.shared_dir).is_dir():
        raise UsageError(
            f"--shared-dir {getattr(args, 'shared_dir', None)}: with --rdzv-endpoint, expected a folder every node "
            "sees (the jobs' checkpoint shards and records are written there by ranks on every host)"
        )


def check_broken(target: str, broken: dict[str, str], tiers: dict) -> None:
    """A target whose tier YAML does not load is refused with that YAML's error; ``all`` names every broken tier."""
    if target in broken:
        raise UsageError(f"tier {target!r} is broken: {broken[target]}")
    if target == "all" and broken:
        names = ", ".join(sorted(broken))
        raise UsageError(
            f"'all' includes broken tier(s) {names}: {next(iter(broken.values()))} "
            f"(fix the YAML, or run the other tiers by name: {', '.join(tiers)})"
        )


def check_implementation(spec: str | None) -> None:
    """``--lora-impl``: a module that cannot be found or a name nobody registered, refused before pytest starts."""
    if spec is None:
        return
    try:
        parsed = parse_spec(spec)
    except SpecError as exc:
        raise UsageError(f"--lora-impl: {exc}") from None
    if parsed.module is not None:  # package.module:factory (is_module)
        module = parsed.module
        sys.path.insert(0, os.getcwd())  # the runs start `python -m pytest` here: this directory is on their path
        try:
            found = importlib.util.find_spec(module)
        except Exception as exc:  # a parent package that is missing, or raises when imported
            why = f"{type(exc).__name__}: {exc}"
            raise UsageError(f"--lora-impl {spec!r}: module {module!r} cannot be found ({why})") from None
        finally:
            sys.path.remove(os.getcwd())
        if found is None:
            raise UsageError(
                f"--lora-impl {spec!r}: no module named {module!r} on the Python path (PYTHONPATH, the current "
                "directory or an installed package)"
            )
        return
    known = known_names()
    if spec not in known:
        raise UsageError(
            f"--lora-impl {spec!r} is not known: expected one of {', '.join(known)}, or package.module:factory"
        )


# The run options selftest would take and ignore: (argparse dest, flag)
SELFTEST_IGNORES = (
    ("lora_impl", "--lora-impl"),
    ("fused_ops", "--fused-ops"),
    ("baseline", "--baseline"),
    ("record", "--record"),
    ("ledger", "--ledger"),
    ("require_gpu", "--require-gpu"),
)


def check_run_options(args, target: str, tiers: dict) -> None:
    """The run options against the target and the machine."""
    if getattr(args, "strict_vram", False) and not args.check_vram:
        raise UsageError("--strict-vram only makes sense with --check-vram")
    if args.baseline and args.baseline != "auto" and not Path(args.baseline).is_dir():
        raise UsageError(f"--baseline {args.baseline}: not a directory (a run folder, or auto)")
    if target == "selftest" and args.report_dir:  # issue 28: it was accepted, and the folder stayed empty
        raise UsageError("--report-dir: selftest (the CPU tests) writes no run report; it is for the GPU targets")
    if target == "selftest" and (given := [flag for dest, flag in SELFTEST_IGNORES if getattr(args, dest, None)]):
        raise UsageError(  # issue 56: `selftest --lora-impl peft` was accepted and ignored
            f"{', '.join(given)}: selftest runs the framework's own CPU tests, which judge no implementation on no GPU "
            "and write no run report; that is for the GPU targets (quick, convergence, ..., selftest-gpu)"
        )
    if getattr(args, "gpus", None) is not None and target not in GPUS_TARGETS:
        raise UsageError(f"--gpus applies to {' and '.join(GPUS_TARGETS)} (torchrun jobs), not to {target!r}")
    check_multinode_options(target, args)
    workers = getattr(args, "workers", None)
    cores = os.cpu_count() or 1
    if workers not in (None, "auto") and int(workers) > cores:
        raise UsageError(f"--workers {workers}: this machine has {cores} CPU core(s); expected 1 to {cores}, or auto")
    check_ledger_option(args)
    if args.report_dir:
        check_report_dir(args.report_dir)
    check_implementation(getattr(args, "lora_impl", None))


def check_ledger_option(args) -> None:
    if getattr(args, "ledger", None) and not getattr(args, "record", False):
        raise UsageError(f"--ledger {args.ledger}: names the ledger --record appends to; add --record (or drop it)")
    if getattr(args, "ledger", None):
        check_store_path(args.ledger)


def check_store_path(location: str) -> None:
    """A ledger or store a command writes (``--ledger``): ``check_output``'s rule (one new folder inside an existing
    one at most); a server's URL other than SQLite's is the server's business."""
    check_output("--ledger", location)


def _missing_parent(path: str) -> Path | None:
    """The folder ``path`` would be made in, where neither ``path`` nor that folder exists (a typo would otherwise
    create a whole path from /); None where it may be created."""
    target = Path(path).resolve()
    return None if target.exists() or target.parent.is_dir() else target.parent


def check_output(what: str, path: str | Path, *, folder: bool = False) -> None:
    """A file a command writes (a page, an exported ledger, a SQLite store), or a ``folder`` (a scorecard's), may be
    new, and so may the one folder it goes in (as ``--report-dir``), but only inside a folder that exists: a
    mistyped path is refused, never created from /. A server's URL is the server's business."""
    text = str(path)
    if "://" in text and not text.startswith("sqlite:///"):
        return
    target = Path(text.removeprefix("sqlite:///"))
    if parent := _missing_parent(str(target if folder else target.parent)):
        raise UsageError(
            f"{what} {path}: {parent} does not exist (expected a path in an existing folder, or in a new folder "
            "inside one: create the folders first with mkdir -p)"
        )


def check_report_dir(path: str) -> None:
    """A report folder may be created, but not a whole missing path."""
    if parent := _missing_parent(path):
        raise UsageError(
            f"--report-dir {path}: its parent {parent} does not exist (expected an existing folder, or a new "
            "folder inside one: create the path first with mkdir -p)"
        )


def check_existing(what: str, paths: Sequence[str | Path], *, kind: str = "run folder") -> None:
    """Paths a command reads: each must exist, and the error names every one that does not."""
    missing = [str(p) for p in paths if "://" not in str(p) and not Path(p).exists()]  # a store URL: opened later
    if missing:
        raise UsageError(f"{what}: {', '.join(missing)} {'does' if len(missing) == 1 else 'do'} not exist (a {kind})")
