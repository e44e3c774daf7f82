"""Where the suite's pytest processes keep compiled bytecode.

An interpreter told not to write bytecode (``PYTHONDONTWRITEBYTECODE``, which many container images set, the GPU
runner's among them, and which ship torch without ``.pyc`` files) compiles every module it imports from source, in
every process: on an H100 runner one process importing torch, transformers' Llama and PEFT took 19.5 s that way and
8.1 s from cached bytecode (reports/README.md, issue 34, item 4). A tier spread over workers pays it once a process.

So the suite's pytest processes keep their bytecode in the suite's own cache folder (``PYTHONPYCACHEPREFIX``), outside
site-packages and the checkout, which the interpreter's setting was protecting: ``LORA_SUITE_PYCACHE=off`` leaves the
interpreter's setting alone, ``LORA_SUITE_PYCACHE=<folder>`` picks the folder. An interpreter that writes bytecode
anyway (no ``PYTHONDONTWRITEBYTECODE``) is left as it is.

The cache fills as the first run's processes import (its workers compile side by side, as they did without it):
filling it first in one process, before the tests, took 36.1 s on a fresh H100 runner, against the 7-10 s the
workers' parallel compiles add to a first run, so there is no separate warm-up.
"""

from __future__ import annotations

import sys
from pathlib import Path

ENV = "LORA_SUITE_PYCACHE"


def cache_folder(env: dict[str, str]) -> Path | None:
    """The folder the suite's processes keep bytecode in, or None where the environment's setting stands."""
    choice = env.get(ENV, "")
    if choice == "off" or not env.get("PYTHONDONTWRITEBYTECODE"):
        return None
    if choice:
        return Path(choice).expanduser()
    if env.get("PYTHONPYCACHEPREFIX"):
        return Path(env["PYTHONPYCACHEPREFIX"])
    base = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "lora-suite" / "pycache"


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a pytest process: bytecode written to ``cache_folder`` where the interpreter was told to write
    none; unchanged where the folder cannot be created (the run goes on, compiling from source as before)."""
    folder = cache_folder(env)
    if folder is None:
        return env
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"lora-suite: bytecode not cached ({ENV}={folder}: {exc.strerror or exc})", file=sys.stderr)
        return env
    out = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out["PYTHONPYCACHEPREFIX"] = str(folder)
    return out
