"""Where the suite's pytest processes keep compiled bytecode.

An interpreter told not to write bytecode (``PYTHONDONTWRITEBYTECODE``, which many container images set, the GPU
runner's among them, and which ship torch without ``.pyc`` files) compiles every module it imports from source, in
every process: on an H100 runner one process importing torch, transformers' Llama and PEFT took 19.5 s that way and
8.1 s from cached bytecode (reports/README.md, issue 34, item 4). A tier spread over workers pays it once a process.

So the suite's pytest processes keep their bytecode in the suite's own cache folder (``PYTHONPYCACHEPREFIX``), outside
site-packages and the checkout, which the interpreter's setting was protecting: ``LORA_SUITE_PYCACHE=off`` leaves the
interpreter's setting alone, ``LORA_SUITE_PYCACHE=<folder>`` picks the folder. An interpreter that writes bytecode
anyway (no ``PYTHONDONTWRITEBYTECODE``) is left as it is.

``compile_packages``: on an interpreter's first GPU run on a machine (an ephemeral CI container: every run), the
packages every test process imports are compiled into the cache first, over all CPU cores (``compileall``, as ``pip
install`` does for what it installs), and the run's wall-time breakdown names that set-up. Importing everything once
in one process instead took 36.1 s on a fresh H100 runner; leaving it to the run, its workers compile side by side.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

from lora_suite.measure.wall_time import SETUP_ENV  # noqa: F401  (the CLI hands the set-up's seconds on)

ENV = "LORA_SUITE_PYCACHE"
# What a GPU tier's test processes import, directly or through torch and transformers (sklearn, scipy and sympy
# among them); a package that is not installed is passed over.
PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "safetensors",
    "huggingface_hub",
    "tokenizers",
    "numpy",
    "scipy",
    "sklearn",
    "sympy",
    "networkx",
    "jinja2",
    "yaml",
    "filelock",
    "fsspec",
    "packaging",
    "regex",
    "tqdm",
    "triton",
    "cupy",
    "cupyx",
    "nvmath",
    "cuda",
    "pynvml",
    "matplotlib",
    "PIL",
    "pytest",
    "_pytest",
    "pluggy",
    "xdist",
    "execnet",
    "pytest_benchmark",
    "lora_core",
    "lora_suite",
)
# Not imported by a test process: test suites, and transformers' other model families (thousands of files)
SKIP = r"(/tests?/|/testing/_internal/|/transformers/models/(?!llama/|auto/)[^/]+/)"
_COMPILE = """
import compileall, importlib.util, re, sys
skip = re.compile(sys.argv[1])
for name in sys.argv[2:]:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        continue
    for place in (spec.submodule_search_locations or []) if spec else []:
        compileall.compile_dir(place, quiet=2, workers=0, rx=skip)
"""


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
    return folder / f".compiled-{hashlib.sha1(os.path.realpath(python).encode()).hexdigest()[:12]}"


def compile_packages(python: str, env: dict[str, str], packages: tuple[str, ...] = PACKAGES) -> float | None:
    """Compile ``packages`` into the bytecode cache of ``env`` (``child_env``'s), once per interpreter; its seconds, or
    None where there is no cache or it was filled already. A file that does not compile is left to the import that
    needs it (which names it); the marker is written either way, so a broken file costs one attempt, not one a run."""
    folder = env.get("PYTHONPYCACHEPREFIX")
    if not folder or "PYTHONDONTWRITEBYTECODE" in env:
        return None
    marker = _marker(Path(folder), python)
    if marker.exists():
        return None
    print(f"lora-suite: compiling the packages the tests import into {folder} (once for this interpreter)", flush=True)
    start = time.perf_counter()
    subprocess.run([python, "-c", _COMPILE, SKIP, *packages], env=env, capture_output=True)
    seconds = time.perf_counter() - start
    marker.write_text(f"{seconds:.2f}\n")
    return seconds
