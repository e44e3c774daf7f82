"""How many pytest-xdist worker processes a tier's run is spread over: ``--workers`` or the tier's default, bounded
by the GPU's memory and the host's cores, as pytest's options."""

from __future__ import annotations

import importlib.util
import os
import sys

from lora_suite.cli import gpus
from lora_suite.cli.plugins import autoload_plugins
from lora_suite.cli.usage import UsageError

# Tiers whose tests are many and short run over workers by default (issue 34; docs/running.md and ledger groups
# `issue34-quick-workers-8`, `issue34-item4-controller-42d1e12` hold the measurements). Each worker peaks near 4 GiB of
# GPU memory and imports torch, so a GPU gets at most total GiB // 4 - 1 and a host one per two CPU cores.
DEFAULT_WORKERS = {"quick": 8}
WORKER_GIB = 4


def default_workers(target: str) -> str | None:
    """The tier's default workers: min(its default, GPU GiB // ``WORKER_GIB`` - 1, cores / 2); None for one."""
    if target not in DEFAULT_WORKERS or gpus.gpu_count() == 0:  # no GPU: every test skips, one process is enough
        return None
    gib = gpus.gpu_memory_gib()
    cap = DEFAULT_WORKERS[target] if gib is None else max(1, int(gib // WORKER_GIB) - 1)
    cores = max(1, (os.cpu_count() or 2) // 2)
    return str(min(DEFAULT_WORKERS[target], cap, cores))


def xdist_available() -> bool:
    return importlib.util.find_spec("xdist") is not None


def worker_args(target: str, workers: str | None) -> list[str]:
    """pytest-xdist's options for ``--workers`` (or the tier's default); none for one worker.

    Asked for explicitly without pytest-xdist installed is a usage error; a tier's default (only where a GPU is
    visible: without one every test skips) falls back to one process and the run says so on stderr; the verdicts
    are the same either way.
    """
    chosen = workers or default_workers(target)
    if chosen is None or chosen == "1":
        return []
    if not xdist_available():
        if workers:
            raise UsageError(f"--workers {workers} needs pytest-xdist: pip install pytest-xdist (or --workers 1)")
        print(f"lora-suite: pytest-xdist is not installed: {target} runs in one process", file=sys.stderr)
        return []
    plugin = [] if autoload_plugins(target) else ["-p", "xdist.plugin"]
    # loadgroup: tests that import the model code share a few workers (harness/worker_groups.py); the other tests are
    # sent one at a time to whichever worker is nearly out of work, the groups first
    return plugin + ["-n", chosen, "--dist", "loadgroup"]
