"""What the plugin's modules share (no hooks here): the stash keys of the run report, the implementation under test,
a test's failed checks and the session's state (``SessionState``, one per pytest config, under ``STATE_KEY``); the
tier registry; and which process this is in a run spread over pytest-xdist workers.

The state has an owner: the config that pytest made for the session holds it, and a hook that gets no config
(``pytest_runtest_logreport``) is a method of a plugin object that was handed the state when it was registered
(``outcomes.PhaseRecords``). No module keeps a session's state in a global: two sessions in one process (pytester's
in-process runs) never see each other's (``tests/suite/repository/test_no_module_state.py``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest

from lora_suite.harness.report import Check, RunReport
from lora_suite.harness.worker_records import Inbox, Outbox
from lora_suite.implementations import LoRAImplementation
from lora_suite.measure.wall_time import SessionClock
from lora_suite.settings.registry import RegisteredTier, registry


@dataclasses.dataclass
class SessionState:
    """One pytest session's record, for the wall-time breakdown (``session_tables``) and the hand-over of records
    between pytest-xdist workers and their controller (``worker_records``). Epoch seconds are ``time.time()``,
    ``start`` is ``time.perf_counter()``; None where the moment has not come (or the process has no such phase)."""

    configured: float | None = None  # when run_report's pytest_configure began (epoch seconds)
    preload_s: float | None = None  # the implementation's preload (a process that runs tests)
    session_start: float | None = None  # pytest_sessionstart (epoch seconds)
    cuda_context_s: float | None = None  # the CUDA context created on its own (None without a GPU, or in a controller)
    workers: int = 0  # the pytest-xdist workers this process drives (0: it runs the tests itself)
    report: RunReport | None = None  # the run report, from the session's start
    clock: SessionClock = dataclasses.field(default_factory=SessionClock)
    start: float | None = None  # the session's start on ``time.perf_counter()``
    unsaved: str | None = None  # why the run report could not be written (a full disk...), once it could not

    def save(self, write, *args):
        """``write(*args)`` (the report's), or, where the machine refuses it (``OSError``: no space, no permission),
        None with the reason kept in ``unsaved``: the run goes on and ends failed saying why, never INTERNALERROR."""
        try:
            return write(*args)
        except OSError as exc:
            where = exc.filename or (args[0] if args else "")
            self.unsaved = self.unsaved or f"the run report was not written to {where}: {exc.strerror or exc}"
            return None

    terminated: bool = False  # a SIGTERM stopped the session (run_report's handler)
    report_dir: str | None = None  # report.json rewritten here after each test (never by a worker)
    outbox: Outbox | None = None  # an xdist worker's: the records it has handed over
    inbox: Inbox | None = None  # the controller's: the records the workers handed over
    worker_outputs: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # each ended worker's last output


REPORT_KEY = pytest.StashKey[RunReport]()
SUMMARY_KEY = pytest.StashKey[list[str]]()  # lines for the terminal summary (report path, wall-time failure)
IMPL_KEY = pytest.StashKey[LoRAImplementation]()
FAILED_KEY = pytest.StashKey[list[tuple[Check, str]]]()  # a test's failed checks: (check, "file:line")
STATE_KEY = pytest.StashKey[SessionState]()


def session_state(config: pytest.Config) -> SessionState:
    """The session's state, made by the first hook that asks for it: no hook has to run before another to make it."""
    if STATE_KEY not in config.stash:
        config.stash[STATE_KEY] = SessionState()
    return config.stash[STATE_KEY]


def is_worker(config: pytest.Config) -> bool:
    """An xdist worker: it runs tests and hands its records to the controlling process."""
    return hasattr(config, "workerinput")


def drives_workers(config: pytest.Config) -> bool:
    """The controlling process of a run spread over pytest-xdist workers (``-n N``): it runs no test itself."""
    return not is_worker(config) and bool(getattr(config.option, "numprocesses", None))


def worker_id(config: pytest.Config) -> str:
    """An xdist worker's id (``gw0``, ...): xdist sets ``config.workerinput`` in a worker."""
    workerinput: dict[str, object] = getattr(config, "workerinput", {})
    return str(workerinput.get("workerid", "worker"))


@functools.cache
def tiers() -> dict[str, RegisteredTier]:
    """The tier registry, read once per process (a broken tier YAML is left out: ``lora_suite.settings.registry``);
    the cache is this function's own."""
    return registry()
