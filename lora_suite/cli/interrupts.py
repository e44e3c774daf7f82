"""A target's pytest child under Ctrl-C and SIGTERM: the signal reaches pytest, which writes its report, and the
command then stops with a summary of what ran instead of dying at once and leaving the child going."""

from __future__ import annotations

import signal
import subprocess


class Terminated(Exception):
    """SIGTERM to the command (a CI job's timeout signals its top process only): without a handler this process
    would die at once and leave its pytest run going, its report never finished."""


def raise_terminated(signum, frame):
    """A SIGTERM handler: raises ``Terminated``, so that the command can stop its child and print its summary."""
    raise Terminated(f"signal {signum}")


def run_pytest(cmd: list[str], env: dict) -> tuple[int, str | None]:
    """Run one target's pytest; (its exit code, None or "INTERRUPTED" / "TERMINATED" when a signal stopped it)."""
    proc = subprocess.Popen(cmd, env=env)
    term = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        return proc.wait(), None
    except KeyboardInterrupt:  # Ctrl-C reached pytest too: let it write its report, then stop the whole run
        return wait_after_interrupt(proc), "INTERRUPTED"
    except Terminated:  # a job's timeout signalled this process alone: pytest gets it too and writes its report
        proc.send_signal(signal.SIGTERM)
        return wait_after_interrupt(proc), "TERMINATED"
    finally:
        signal.signal(signal.SIGTERM, term)


def wait_after_interrupt(proc: subprocess.Popen) -> int:
    """Wait for pytest to write its report after the first signal; a second Ctrl-C or SIGTERM (a job's timeout that
    signals the whole process group, or signals again) must neither leave the report half written nor raise here
    while the first is handled (issue 56: two chained tracebacks before the summary)."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
