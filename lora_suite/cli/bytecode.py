"""Where the suite's pytest processes keep compiled bytecode.

An interpreter told not to write bytecode (``PYTHONDONTWRITEBYTECODE``, which many container images set, the GPU
runner's among them, and which ship torch without ``.pyc`` files) compiles every module it imports from source, in
every process: on an H100 runner one process importing torch, transformers' Llama and PEFT took 19.5 s that way and
8.1 s from cached bytecode (reports/README.md, issue 34, item 4). A tier spread over workers pays it once a process.

So the suite's pytest processes keep their bytecode in the suite's own cache folder (``PYTHONPYCACHEPREFIX``), outside
site-packages and the checkout, which the interpreter's setting was protecting: ``LORA_SUITE_PYCACHE=off`` leaves the
interpreter's setting alone, ``LORA_SUITE_PYCACHE=<folder>`` picks the folder. An interpreter that writes bytecode
anyway (no ``PYTHONDONTWRITEBYTECODE``) is left as it is.

``warm_up``: the first GPU run on a machine fills the cache once, importing what every test process imports, before
its tests start (the set-up ``pip install`` does for the packages it installs); the run's wall-time breakdown names it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

ENV = "LORA_SUITE_PYCACHE"
WARMUP_ENV = "LORA_SUITE_BYTECODE_WARMUP_S"  # the warm-up's seconds, for the report's wall-time breakdown
# What every pytest process of a GPU tier imports (the plugin, the engine, the model code, the references)
WARM_IMPORTS = (
    "torch",
    "transformers.models.llama.modeling_llama",
    "peft",
    "cupy",
    "lora_core",
    "lora_suite.harness.pytest_plugin",
    "lora_suite.engine.prepare",
    "lora_suite.engine.round_trip",
)


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


def _marker(folder: Path, python: str) -> Path:
    """One marker per interpreter: another Python's bytecode is another set of files."""
    return folder / f".warmed-{hashlib.sha1(os.path.realpath(python).encode()).hexdigest()[:12]}"


def warm_up(python: str, env: dict[str, str], imports: tuple[str, ...] = WARM_IMPORTS) -> float | None:
    """Fill the bytecode cache of ``env`` (``child_env``'s) once per interpreter: import ``imports`` in one process.
    Returns its seconds, or None where there is no cache or it was already filled. A module that fails to import is
    left to the tests, which name it."""
    folder = env.get("PYTHONPYCACHEPREFIX")
    if not folder or "PYTHONDONTWRITEBYTECODE" in env:
        return None
    marker = _marker(Path(folder), python)
    if marker.exists():
        return None
    print(f"lora-suite: compiling the bytecode of {', '.join(imports)} into {folder} (once for this interpreter)")
    start = time.perf_counter()
    code = "import importlib\nfor m in {!r}:\n    try: importlib.import_module(m)\n    except Exception: pass\n"
    subprocess.run([python, "-c", code.format(list(imports))], env=env, capture_output=True)
    seconds = time.perf_counter() - start
    marker.write_text(f"{seconds:.2f}\n")
    return seconds
