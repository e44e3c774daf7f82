"""Test processes forked from one that has already imported the heavy packages (``lora-suite mutate``'s runs).

A mutant's run of the checks is a fresh Python process that imports torch, transformers and PEFT before its first
test: seconds of every run, and on a host shared by several runs the larger part of a killed mutant's time. A
*fork server* imports those packages once and forks one child per run; the child starts from that state, sets the
run's environment and arguments, and runs the command as ``python -m MODULE`` or ``python -c CODE`` would. Each run is
still a process of its own (a mutant's crash, its CUDA context and its threads end with it).

What the server may hold before a fork is checked when it starts, and it refuses to serve (``ForkServerError``) where

    a module under mutation (``forbid``) was imported by the preloads: the children would run the original source;
    CUDA was initialised by the preloads: a forked child cannot use the parent's CUDA context;
    a preload started a thread: a fork copies only the forking thread, and locks another thread held stay held.

Only commands of the forms ``[python, "-m", module, args…]`` and ``[python, "-c", code, args…]`` are served;
``run_subprocess`` runs any command the ordinary way, with the same result type.

The protocol is JSON lines: the client writes ``{"id", "argv", "env", "output"}`` to the server's stdin; the server
answers ``{"id", "pid"}`` when the child starts and ``{"id", "rc"}`` when it ends. The child's stdout and stderr go
to the ``output`` file. A run past its timeout is killed (its process group) by the client.
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

READY = "ready"


class ForkServerError(RuntimeError):
    """The fork server cannot serve runs (the message names why: a preload, CUDA, a thread, an exit)."""


@dataclass(frozen=True)
class Finished:
    """One run: its exit code (None where it passed its timeout and was killed) and its output."""

    returncode: int | None
    output: str
    seconds: float


def run_subprocess(argv: list[str], env: dict[str, str], timeout: float) -> Finished:
    """``argv`` as an ordinary child process."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return Finished(None, out, time.perf_counter() - start)
    return Finished(proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start)


def servable(argv: list[str]) -> bool:
    return len(argv) >= 3 and argv[1] in ("-m", "-c")


class ForkServer:
    """The client: starts the server (``python -m lora_suite.mutation.forked_runs``) and runs commands through it.
    Safe to use from several threads at once."""

    def __init__(self, python: str, env: dict[str, str], preload: list[str], forbid: list[str], workdir: Path):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [python, "-m", "lora_suite.mutation.forked_runs", "--preload", ",".join(preload)]
        argv += ["--forbid", ",".join(forbid)]
        self._log = self.workdir / "fork-server.log"  # its own warnings; never a pipe nobody reads
        with open(self._log, "w") as log:
            self._proc = subprocess.Popen(
                argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )
        assert self._proc.stdin is not None and self._proc.stdout is not None  # both were asked for as PIPEs
        self._stdin, self._stdout = self._proc.stdin, self._proc.stdout
        first = self._stdout.readline().strip()
        if first != READY:
            self._proc.wait(timeout=30)
            raise ForkServerError(_last(self._log.read_text()) or f"the fork server exited {self._proc.returncode}")
        self._closed = False
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[int, dict] = {}  # id -> what the server said of it: {"pid": …, "rc": …}
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._stdout:
            msg = json.loads(line)
            with self._cv:
                self._waiting.setdefault(msg["id"], {}).update(msg)
                self._cv.notify_all()
        with self._cv:  # the server is gone: every waiting run ends
            self._closed = True
            self._cv.notify_all()

    def run(self, argv: list[str], env: dict[str, str], timeout: float) -> Finished:
        """``argv`` (a servable command) in a child of the server, with ``env`` as its whole environment."""
        if not servable(argv):
            return run_subprocess(argv, env, timeout)
        start = time.perf_counter()
        with self._lock:
            self._next += 1
            ident = self._next
            output = self.workdir / f"run-{ident}.out"
            self._stdin.write(json.dumps({"id": ident, "argv": argv, "env": env, "output": str(output)}) + "\n")
            self._stdin.flush()
        deadline = start + timeout
        with self._cv:
            while "rc" not in self._waiting.get(ident, {}) and not self._closed:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._cv.wait(min(left, 1.0))
            msg = self._waiting.pop(ident, {})
        if "rc" not in msg:
            if "pid" in msg:
                _kill_group(msg["pid"])
            if self._closed and time.perf_counter() < deadline:
                raise ForkServerError(f"the fork server exited during a run: {_last(self._log.read_text())}")
        text = output.read_text(errors="replace") if output.is_file() else ""
        output.unlink(missing_ok=True)
        return Finished(msg.get("rc"), text, time.perf_counter() - start)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _last(text: str) -> str:
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


# ---- the server side -------------------------------------------------------------------------------------------


def preload(modules: list[str], forbid: list[str]) -> None:
    """Import ``modules``; raise ``ForkServerError`` where that makes forking unsafe or the runs untrue."""
    for name in modules:
        importlib.import_module(name)
    imported = [m for m in forbid if m in sys.modules]
    if imported:
        raise ForkServerError(
            f"preloading {', '.join(modules)} imported {', '.join(imported)}, the module(s) under "
            "mutation: the runs would judge the original source"
        )
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise ForkServerError(f"preloading {', '.join(modules)} initialised CUDA: a forked child could not use it")
    if threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.main_thread())
        raise ForkServerError(f"preloading {', '.join(modules)} started threads ({names}): forking is not safe")


def _child(request: dict) -> None:
    """In the forked child: the run's environment, arguments and output; never returns."""
    code = 1
    try:
        os.setsid()  # a group of its own: a timeout kills it and whatever it started
        fd = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"]
        code = _main(argv[1], argv[2], argv[3:])
    except BaseException as exc:  # noqa: BLE001 - whatever ends the run is its exit code and output
        import traceback

        traceback.print_exception(exc)
    finally:
        import atexit

        atexit._run_exitfuncs()  # as a process's exit runs them (a line trace is written by one)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _main(flag: str, target: str, args: list[str]) -> int:
    """``python -m target args`` or ``python -c target args``, in this process; its exit code."""
    import runpy

    try:
        if flag == "-m":
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - python -c, as asked
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def serve(modules: list[str], forbid: list[str]) -> int:
    try:
        preload(modules, forbid)
    except Exception as exc:  # noqa: BLE001 - the client reads the reason from stderr
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    out = sys.stdout
    out.write(READY + "\n")
    out.flush()
    children: dict[int, int] = {}  # pid -> request id
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ)
    open_input, pending = True, b""
    while open_input or children:
        if open_input and sel.select(timeout=0.05):
            data = os.read(0, 1 << 16)  # unbuffered: select() sees every byte not yet read
            if not data:
                open_input = False
                sel.unregister(0)
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in (ln for ln in lines if ln.strip()):
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request)
                children[pid] = request["id"]
                out.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")
                out.flush()
        elif not open_input:
            time.sleep(0.05)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            out.write(json.dumps({"id": children.pop(pid), "rc": os.waitstatus_to_exitcode(status)}) + "\n")
            out.flush()
    return 0


def _names(text: str) -> list[str]:
    return [n for n in text.split(",") if n]


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(serve(_names(args[args.index("--preload") + 1]), _names(args[args.index("--forbid") + 1])))
