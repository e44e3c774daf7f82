"""``lora-suite`` (and ``python -m lora_suite``): one subcommand per target, ``--help`` on each.

    lora-suite TARGET [options] [-- extra pytest args]

Targets: every tier of the tier registry (``configs/<tier>.yaml`` with a ``suite:`` section, run from
``tiers/<tier>/``), ``all``, ``bench``, ``selftest``, ``selftest-gpu``, ``scorecard``, ``render-scorecard``,
``history``, ``compare``, ``ledger`` and ``mutate``. Exit codes: 0 passed, 1 a target failed (or a regression was found),
2 bad usage, 4 not judged (a target judged nothing on a GPU, or ``--require-gpu`` found none), 130 interrupted. ``scripts/gpu-test.sh`` sets up ``.venv`` where needed and hands over to this.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lora_suite.cli import campaigns, mutation, preflight, targets
from lora_suite.cli.option_values import (
    _endpoint,
    _impl,
    _node_rank,
    _positive_int,
    _vram_limit,
    _weights,
    _workers,
)
from lora_suite.cli.usage import UsageError, check_text_values, check_values
from lora_suite.settings.env_vars import environment_problem
from lora_suite.settings.memory_options import MEMORY_OPTIONS

TOOLS = {
    "selftest": "the framework's own CPU tests (a checkout's tests/; what CI runs)",
    "selftest-gpu": "planted defects each criterion must catch: the suite's own sensitivity, on a GPU",
    "bench": "pytest-benchmark: the layer forward+backward against the base layer and PEFT, NF4 kernels against "
    "bitsandbytes, training steps end to end",
    "scorecard": "every selected (default: installed) implementation through quick, convergence and memory, then the "
    "interleaved training benchmark; writes scorecard.md / .html / .json",
    "render-scorecard": "the scorecard rebuilt from run folders and/or the ledger, without running anything",
    "history": "every judged figure over time from the ledger (and run folders), per GPU, implementation and tier",
    "compare": "the night-to-night regression gate between two run folders (exit 1 on a regression)",
    "ledger": "the results ledger: record run folders' judged figures as rows, or show rows",
    "mutate": "mutation testing of a stack's own source: each mutant through quick's fast checks on the GPU, "
    "killed / survived / equivalent, the mutation score against --min-score (default 0.9)",
}


EPILOG = """run options (tiers, all, bench, selftest-gpu; `lora-suite TARGET --help` lists each target's):
  --check-vram / --strict-vram   the LoRA-aware memory estimate against NVML free memory first; skip (or fail) if short
  --vram-limit GIB / --oom-retry judge as on a card of GIB GiB; a test out of memory runs again with half the
                                 micro-batch (its pass reads PASS (RETRIED)); an out-of-memory is a verdict, not a crash
  --continue-on-error            run the remaining targets after a failure (the exit code is still 1; an
                                 out-of-memory stops nothing)
  --report-dir DIR               runs go to DIR/<run-id>/ (default reports/, ignored by git: CI keeps them as artifacts)
  --lora-impl NAME|MODULE:FACTORY   the implementation under test (default cupy)
  --weights auto|pretrained|random  --gpus N  --workers N|auto  --baseline DIR|auto  -v/--verbose
  --nodes N [--node-rank K --rdzv-endpoint HOST:PORT --shared-dir DIR]   multinode: nodes per job; across hosts
                                 each host runs its node K (docs/multinode.md)
  --record [--ledger STORE]      append each run's judged figures to the results store (default reports/results.sqlite,
                                 or $LORA_SUITE_STORE: a team's PostgreSQL URL)
  --require-gpu                  no CUDA GPU is a failure (exit 4), not a run whose GPU tests skip (also
                                 LORA_SUITE_REQUIRE_GPU=1: for CI runners that must have one)

A target whose tests all skipped (the VRAM pre-check, every test not applicable, nothing selected) judged nothing: its
verdict is NOT JUDGED (why), never PASS. Exit codes: 0 all passed, or judged nothing because the machine has no GPU
(the summary says NOT JUDGED (no GPU)), 1 a target failed or a regression was found, 2 bad usage, 4 not judged (a
target judged nothing on a machine with a GPU, or --require-gpu found none), 130 interrupted (scripts/gpu-test.sh
adds 3: the Python environment could not be set up)."""


def registry_names() -> list[str]:
    return list(_broken_and_tiers()[1])


def _broken_and_tiers() -> tuple[dict, dict]:
    from lora_suite.settings.registry import scan

    tiers, broken = scan()
    return broken, tiers


class _Offered:
    """An argument group that adds an option only where it applies to the target (``preflight.ONLY_FOR``)."""

    def __init__(self, group, target: str | None):
        self.group, self.target = group, target

    def add_argument(self, *flags: str, **kwargs):
        only = preflight.ONLY_FOR.get(flags[-1])
        if only is None or self.target is None or self.target in only:
            self.group.add_argument(*flags, **kwargs)


class Parser(argparse.ArgumentParser):
    """argparse with the suite's usage errors: one line naming the bad value, then where help is; exit 2."""

    def error(self, message):
        raise UsageError(message)


def _memory_options(g) -> None:
    """The run options of the card's memory (``lora_suite.settings.memory_options``); a ``--vram-limit`` below 1 GiB
    or not a number is refused here."""
    for option in MEMORY_OPTIONS:
        kwargs: dict = option.kwargs()
        if option.name == "--vram-limit":
            kwargs["type"] = _vram_limit
        g.add_argument(option.name, **kwargs)


def _run_options(p: argparse.ArgumentParser, tier: bool = True, target: str | None = None) -> None:
    """The run options of ``target``: an option of some targets only (``preflight.ONLY_FOR``) is not offered, nor
    listed by ``--help``, elsewhere (given there, it is refused by name)."""
    group = p.add_argument_group("run options")
    g = _Offered(group, target)
    if tier:
        _memory_options(g)
        g.add_argument("--weights", type=_weights, help="auto, pretrained or random: override the tiers' weights mode")
        g.add_argument("--gpus", type=_positive_int("--gpus"), help="multigpu: processes (GPUs) per torchrun job")
        g.add_argument(
            "--nodes",
            type=_positive_int("--nodes", 2, " (a job over one node is the multigpu tier's)"),
            help="multinode: nodes per job (default 2)",
        )
        g.add_argument("--node-rank", type=_node_rank, help="multinode across hosts: the node this host runs")
        g.add_argument("--rdzv-endpoint", type=_endpoint, help="multinode across hosts: node 0's HOST:PORT")
        g.add_argument("--shared-dir", help="multinode across hosts: a folder every node sees")
        g.add_argument(
            "--workers",
            type=_workers,
            help="spread the tier's tests over N pytest-xdist worker processes (auto: one per CPU core), one merged "
            "report; at most the CPU count; default: quick 8 (at most one per two CPU cores, fewer on GPUs under 36 GiB) "
            "where pytest-xdist imports and a GPU is visible, the others 1",
        )
    g.add_argument("--continue-on-error", action="store_true", help="run the remaining targets after a failure")
    g.add_argument("--report-dir", help="run reports go to DIR/<run-id>/ (default: reports/, ignored by git)")
    g.add_argument(
        "--lora-impl",
        type=_impl,
        help="the implementation under test: cupy (default), cupy-fused, torch, peft, peft-bnb, loralib, torchtune, "
        "axolotl, peft-liger, unsloth, transformers-adapter, an entry point, or package.module:factory",
    )
    g.add_argument(
        "--fused-ops",
        choices=("liger",),
        help="apply fused non-LoRA ops to the model under test: liger (Liger-Kernel's RMSNorm, RoPE, SwiGLU, fused "
        "linear cross-entropy)",
    )
    g.add_argument(
        "--baseline",
        help="compare each target's run with DIR/<target> (auto: reports/baselines/<GPU>); a regression fails it",
    )
    g.add_argument("--record", action="store_true", help="append each finished run's judged figures to the ledger")
    g.add_argument(
        "--ledger",
        help="the store (URL or .sqlite) or .jsonl file --record appends to (default: $LORA_SUITE_STORE, else reports/results.sqlite)",
    )
    g.add_argument(
        "--require-gpu",
        action="store_true",
        help="fail (exit 4) when no CUDA GPU is found instead of skipping the GPU tests (or LORA_SUITE_REQUIRE_GPU=1)",
    )
    g.add_argument("-v", "--verbose", action="store_true", help="verbose pytest output with live progress lines")


def build_parser() -> Parser:
    from lora_suite.settings.registry import scan

    tiers, broken = scan()
    p = Parser(
        prog="lora-suite",
        description="The LoRA GPU validation suite: one subcommand per target, --help on each.",
        formatter_class=argparse.RawTextHelpFormatter,
        epilog=EPILOG,
    )
    sub = p.add_subparsers(dest="target", metavar="TARGET", parser_class=Parser)
    for name, t in tiers.items():
        desc = t.entry.description.replace("%", "%%")  # argparse formats help with %
        _run_options(sub.add_parser(name, help=desc, description=desc), target=name)
    for name, error in broken.items():  # listed, and refused with its error when run (cli/preflight.py)
        sub.add_parser(name, help=f"BROKEN: {error}".replace("%", "%%"), add_help=False)
    names = ", ".join(n for n, t in tiers.items() if t.entry.in_all)
    _run_options(
        sub.add_parser(
            "all",
            help=f"the tiers of the registry in order ({names}); those needing more GPUs only where they are visible",
        ),
        target="all",
    )
    _run_options(sub.add_parser("bench", help=TOOLS["bench"]), tier=False)
    _run_options(sub.add_parser("selftest-gpu", help=TOOLS["selftest-gpu"]), tier=False)
    _run_options(sub.add_parser("selftest", help=TOOLS["selftest"]), tier=False)
    _campaign_parsers(sub)
    mutation.add_parser(sub, TOOLS["mutate"])
    _ledger_parser(sub)
    return p


def _target_names(parser: argparse.ArgumentParser) -> list[str]:
    """The names of ``parser``'s subcommands (the targets), in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    raise ValueError(f"parser {parser.prog!r} has no subcommands; expected the one build_parser makes")


def _campaign_parsers(sub) -> None:
    """scorecard, render-scorecard, history and compare: the targets that read or run many runs."""
    s = sub.add_parser("scorecard", help=TOOLS["scorecard"])
    s.add_argument("--lora-impl", dest="impls", help="implementations, comma-separated (default: every one installed)")
    s.add_argument("--report-dir", help="where the scorecard's runs go (default: reports/<stamp>-scorecard)")
    s.add_argument("--check-vram", action="store_true")
    s.add_argument("--jobs", type=_positive_int("--jobs"), default=1, help="implementations run at once (lanes)")
    s.add_argument("--no-bench", action="store_true", help="the tiers only, no training benchmark")
    s.add_argument("--record", action="store_true", help="append every run's figures to the ledger")
    s.add_argument(
        "--ledger",
        help="the store (URL or .sqlite) or .jsonl file --record appends to (default: $LORA_SUITE_STORE, else reports/results.sqlite)",
    )
    r = sub.add_parser("render-scorecard", help=TOOLS["render-scorecard"])
    r.add_argument("out", help="folder for scorecard.md / .html / .json")
    r.add_argument("dirs", nargs="*", help="run folders to read (report.json under them)")
    r.add_argument("--ledger", help="read the ledger too (default: none unless --group is given)")
    r.add_argument("--group", help="only the ledger's runs of this group (a campaign folder's name)")
    h = sub.add_parser("history", help=TOOLS["history"])
    h.add_argument("dirs", nargs="*", help="run folders to read besides the ledger")
    h.add_argument(
        "--ledger", help="the store or ledger file to read (default: the store, then reports/ledger.jsonl.gz)"
    )
    h.add_argument("--no-ledger", action="store_true", help="run folders only")
    h.add_argument("--html", help="the page to write (default: reports/history/history.html)")
    c = sub.add_parser("compare", help=TOOLS["compare"])
    c.add_argument("runs", nargs="*", metavar="BASELINE RUN", help="two run folders (or their report/benchmark JSON)")


def _ledger_parser(sub) -> None:
    """ledger record, show, import and export."""
    lg = sub.add_parser("ledger", help=TOOLS["ledger"])
    lsub = lg.add_subparsers(dest="action", metavar="ACTION", parser_class=Parser, required=True)
    rec = lsub.add_parser("record", help="append the judged figures of run folders (report.json) to the ledger")
    rec.add_argument("runs", nargs="+", help="run folders, or folders holding them")
    rec.add_argument("--ledger", help="a store URL or file (default: $LORA_SUITE_STORE, else reports/results.sqlite)")
    rec.add_argument("--group", help="the group the runs belong to (default: the folder holding each run)")
    show = lsub.add_parser("show", help="print the ledger's rows, filtered")
    show.add_argument("--ledger", help="default: the store, then the published reports/ledger.jsonl.gz")
    show.add_argument("--run", help="only this run id (a prefix is enough)")
    show.add_argument("--check", help="only checks whose name contains this text")
    for action, what in (("import", "copy a ledger file's rows into the store"), ("export", "copy rows into a file")):
        x = lsub.add_parser(action, help=f"{what} (runs it holds already are skipped)")
        x.add_argument("file", help="a JSON-lines ledger (or another store's URL)")
        x.add_argument("--ledger", help="the store (default: $LORA_SUITE_STORE, else reports/results.sqlite)")
        x.add_argument("--run", help="only this run id (a prefix is enough)")
        x.add_argument("--group", help="only the runs of this group")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    try:
        parser = build_parser()
        if not argv:
            raise UsageError("no target given (" + ", ".join(_target_names(parser)) + ")")
        if argv[0] in ("-h", "--help"):
            parser.print_help()
            return 0
        choices = _target_names(parser)
        if not argv[0].startswith("-") and argv[0] not in choices:
            raise UsageError(f"unknown target {argv[0]!r} (expected one of: {', '.join(choices)})")
        check_values(argv)
        if (problem := environment_problem()) is not None:
            raise UsageError(problem)
        preflight.check_broken(argv[0], *_broken_and_tiers())
        args, unknown = parser.parse_known_args(argv)
        check_text_values(args)
        if unknown:
            first = unknown[0]
            if (flag := first.split("=", 1)[0]) in preflight.ONLY_FOR:
                raise UsageError(f"{flag} applies to {' and '.join(preflight.ONLY_FOR[flag])} only, not to {argv[0]!r}")
            if first.startswith("-"):
                raise UsageError(f"unknown option {first!r}")
            if args.target in ("all", *registry_names()):
                raise UsageError(f"only one target allowed, got {argv[0]!r} and {first!r}")
            raise UsageError(f"unexpected argument {first!r} for {args.target}")
        return dispatch(args, extra)
    except UsageError as exc:
        print(f"lora-suite: {exc}", file=sys.stderr)
        print("Run 'lora-suite --help' (or 'lora-suite TARGET --help') for usage.", file=sys.stderr)
        return 2
    except OSError as exc:  # the machine's answer about a path (too long, no space, no permission): one line, no trace
        print(f"lora-suite: {_shown_path(exc.filename)}: {exc.strerror or exc}", file=sys.stderr)
        return 2


def _shown_path(name) -> str:
    """A path as a message shows it: a very long one cut in the middle, with its length."""
    text = str(name)
    return text if len(text) <= 200 else f"{text[:90]}...{text[-90:]} ({len(text)} characters)"


def _compare(args) -> int:
    from lora_suite.results import compare

    if len(args.runs) != 2:
        raise UsageError(f"compare needs two run directories: compare BASELINE RUN, got {len(args.runs)}")
    preflight.check_existing("compare", args.runs)
    if Path(args.runs[0]).resolve() == Path(args.runs[1]).resolve():
        raise UsageError(f"compare: {args.runs[0]} is both the baseline and the run; expected two different runs")
    return compare.main(args.runs)


# The targets that are not runs of the tiers: each one function of the argparse namespace
COMMANDS = {
    "scorecard": campaigns.scorecard,
    "render-scorecard": campaigns.render_scorecard,
    "history": campaigns.history,
    "compare": _compare,
    "ledger": campaigns.ledger_command,
    "mutate": mutation.mutate,
}


def dispatch(args, extra: list[str]) -> int:
    """The command the target names; every other target (the tiers, all, bench, selftest...) is a run of pytest."""
    command = COMMANDS.get(args.target)
    return command(args) if command else targets.run_targets(args, extra)
