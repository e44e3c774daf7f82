"""What the plugin's modules share (no hooks here): the stash keys of the run report, the implementation under test
and a test's failed checks; ``RUN``, the session's record for the hooks that get no config; and which process this
is in a run spread over pytest-xdist workers."""

from __future__ import annotations

import pytest

from lora_suite.harness.report import Check, RunReport
from lora_suite.implementations import LoRAImplementation
from lora_suite.settings.registry import RegisteredTier, registry

REPORT_KEY = pytest.StashKey[RunReport]()
SUMMARY_KEY = pytest.StashKey[list[str]]()  # lines for the terminal summary (report path, wall-time failure)
IMPL_KEY = pytest.StashKey[LoRAImplementation]()
FAILED_KEY = pytest.StashKey[list[tuple[Check, str]]]()  # a test's failed checks: (check, "file:line")

# pytest_runtest_logreport gets no config: the session's report, clock and start times are kept here, with the
# worker mailboxes (harness/worker_records.py) and the tier registry (session_tables.py reads it as ``state``).
RUN: dict[str, object] = {}


def is_worker(config: pytest.Config) -> bool:
    """An xdist worker: it runs tests and hands its records to the controlling process."""
    return hasattr(config, "workerinput")


def drives_workers(config: pytest.Config) -> bool:
    """The controlling process of a run spread over pytest-xdist workers (``-n N``): it runs no test itself."""
    return not is_worker(config) and bool(getattr(config.option, "numprocesses", None))


def worker_id(config: pytest.Config) -> str:
    """An xdist worker's id (``gw0``, ...)."""
    return str(config.workerinput.get("workerid", "worker"))


def tiers() -> dict[str, RegisteredTier]:
    """The tier registry, read once per process (a broken tier YAML is left out: ``lora_suite.settings.registry``)."""
    if "tiers" not in RUN:
        RUN["tiers"] = registry()
    return RUN["tiers"]
