"""The lines of a source file that a test process executes: which mutants ``lora-suite mutate`` must run at all.

A mutant whose mutated line the unmutated source's run of the checks never executed cannot change that run: up to
that line the mutant's code is the source's, and the run never gets there (the checks are seeded; a rerun takes the
same path). Such a mutant passes the checks without running them; only its fingerprint then tells an equivalent mutant
from a survivor (``lora_suite.mutation.mutate``).

The process is told what to trace by two environment variables,

    LORA_SUITE_TRACE_FILES=<file>[<os.pathsep><file>…]   LORA_SUITE_TRACE_OUT=<a JSON file to write at exit>

and writes ``{"every_thread": bool, "lines": {file: [line, …]}, "tests": {file: {line: [test id, …]}}}``: for each
line, the tests that ran it (pytest's ``PYTEST_CURRENT_TEST`` without its phase; "" for a line run outside any test,
at import or collection), so a mutation run can start each mutant with the tests that reach its line. On Python 3.12 and later ``sys.monitoring`` sees
every thread (autograd runs a custom Function's backward on CUDA tensors on threads of its own); before 3.12,
``sys.settrace`` and ``threading.settrace`` see only the threads Python starts, so the trace says ``every_thread:
false`` and a mutation run then skips nothing on it.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from pathlib import Path

FILES_ENV, OUT_ENV = "LORA_SUITE_TRACE_FILES", "LORA_SUITE_TRACE_OUT"
TEST_ENV = "PYTEST_CURRENT_TEST"  # pytest sets it to "<node id> (<phase>)" while a test runs
_TOOL_NAME = "lora-suite line trace"


class LineTrace:
    """Executed lines of ``files`` (resolved paths), recorded from ``start`` on."""

    def __init__(self, files):
        self.files = {str(Path(f).resolve()) for f in files}
        self.lines: dict[str, set[int]] = {f: set() for f in self.files}
        self.tests: dict[str, dict[int, set[str]]] = {f: {} for f in self.files}  # file -> line -> test ids
        self._names: dict[str, str | None] = {}  # co_filename -> the traced file it is, or None
        self.every_thread = False  # whether lines run on threads Python did not start are seen too

    def _which(self, filename: str) -> str | None:
        if filename not in self._names:
            resolved = str(Path(filename).resolve()) if filename and not filename.startswith("<") else ""
            self._names[filename] = resolved if resolved in self.files else None
        return self._names[filename]

    def start(self) -> LineTrace:
        monitoring = getattr(sys, "monitoring", None)
        self.every_thread = monitoring is not None
        if monitoring is not None:
            tool = monitoring.COVERAGE_ID
            monitoring.use_tool_id(tool, _TOOL_NAME)

            def on_line(code, line):
                which = self._which(code.co_filename)
                if which is None:
                    return monitoring.DISABLE  # a file not traced: never again at this location
                self._add(which, line)  # a traced file's line stays armed: a later test may run it too

            monitoring.register_callback(tool, monitoring.events.LINE, on_line)
            monitoring.set_events(tool, monitoring.events.LINE)
        else:

            def local(frame, event, arg):
                if event == "line":
                    which = self._which(frame.f_code.co_filename)
                    assert which is not None  # global_ hands this tracer to frames of traced files only
                    self._add(which, frame.f_lineno)
                return local

            def global_(frame, event, arg):
                return local if self._which(frame.f_code.co_filename) is not None else None

            threading.settrace(global_)
            sys.settrace(global_)
        return self

    def _add(self, which: str, line: int) -> None:
        self.lines[which].add(line)
        test = os.environ.get(TEST_ENV, "").rsplit(" (", 1)[0]
        self.tests[which].setdefault(line, set()).add(test)

    def as_json(self) -> dict:
        return {
            "every_thread": self.every_thread,
            "lines": {f: sorted(lines) for f, lines in self.lines.items()},
            "tests": {f: {str(n): sorted(ids) for n, ids in sorted(by.items())} for f, by in self.tests.items()},
        }


def start_from_env(environ=None) -> LineTrace | None:
    """Start a ``LineTrace`` of the files the environment names, written to its output at exit; None where unset."""
    env = os.environ if environ is None else environ
    files, out = env.get(FILES_ENV), env.get(OUT_ENV)
    if not files:
        return None
    if not out:
        raise ValueError(f"{FILES_ENV} is set ({files!r}) without {OUT_ENV}: nowhere to write the executed lines")
    trace = LineTrace(files.split(os.pathsep)).start()

    def write():
        tmp = Path(out + ".tmp")
        tmp.write_text(json.dumps(trace.as_json()))
        tmp.replace(out)  # whole or absent: a reader never sees half of it

    atexit.register(write)
    return trace


def trace_env(files, out: str | Path) -> dict[str, str]:
    """The environment variables that make a test process record the executed lines of ``files`` into ``out``."""
    return with_child_plugin({FILES_ENV: os.pathsep.join(str(Path(f).resolve()) for f in files), OUT_ENV: str(out)})


CHILD_PLUGIN_OPTION = "-p lora_suite.mutation.child"


def with_child_plugin(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus a ``PYTEST_ADDOPTS`` that makes a pytest process import ``lora_suite.mutation.child`` first (the
    caller's own ``PYTEST_ADDOPTS`` kept)."""
    addopts = os.environ.get("PYTEST_ADDOPTS", "")
    if CHILD_PLUGIN_OPTION not in addopts:
        addopts = f"{addopts} {CHILD_PLUGIN_OPTION}".strip()
    return {**env, "PYTEST_ADDOPTS": addopts}


def statement_starts(source: str) -> dict[int, int]:
    """Each line of ``source`` -> the first line of the innermost statement that spans it (a line event of a
    statement that spans lines may come from its first line only)."""
    import ast

    starts: dict[int, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.stmt):
            for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                if starts.get(line, 0) < node.lineno:  # the innermost statement starts last
                    starts[line] = node.lineno
    return starts


def tests_of(line: int, tests: dict[str, list[str]], starts: dict[int, int]) -> set[str] | None:
    """The tests that ran ``line`` (or its statement's first line), from a trace's ``tests`` of one file; None where
    it also ran outside any test (at import or collection: every test may depend on it)."""
    ids = set(tests.get(str(line), ())) | set(tests.get(str(starts.get(line, line)), ()))
    return None if "" in ids else ids


def executed(line: int, lines: set[int], starts: dict[int, int]) -> bool:
    """Whether ``line`` (or the statement it belongs to) ran: conservative, so a mutant is skipped only when sure."""
    return line in lines or starts.get(line, line) in lines
