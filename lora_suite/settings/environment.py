"""What a report must say about where it ran: GPU, driver, CUDA, library versions, git commit."""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib.metadata
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Environment:
    gpu_name: str | None  # None: no CUDA GPU visible to torch
    compute_capability: str | None
    gpu_memory_gib: float | None
    driver: str | None
    cuda: str | None  # the CUDA version torch was built with
    torch: str
    cupy: str | None  # None: CuPy does not import here
    nvmath: str | None  # nvmath-python, whose cuBLAS binding runs the cupy op's GEMMs; None: not installed
    transformers: str | None
    peft: str | None
    python: str
    git_commit: str
    git_dirty: bool
    hostname: str
    timestamp_utc: str
    host_gpus: int | None = (
        None  # GPUs on the host as NVML counts them (CUDA_VISIBLE_DEVICES hides none); None: no NVML
    )


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


COMMIT_ENV = "LORA_SUITE_GIT_COMMIT"  # for copies of the tree without .git (e.g. a GPU runner's copy)


def git_state(root: Path = PROJECT_ROOT) -> tuple[str, bool]:
    """(commit hash, whether tracked files differ from it).

    $LORA_SUITE_GIT_COMMIT, when set, wins, marked as such: a copy of the tree on another machine can carry
    a .git of another commit (a copy of the tree on a GPU runner reported the last landed commit, dirty, for a run of
    a later one). Otherwise read with git (``safe.directory`` set: a copied tree is often owned by another
    user, and git then refuses it); where git cannot answer, 'unknown'. Dirtiness is False when unknown.
    """
    env = os.environ.get(COMMIT_ENV)
    if env:
        return f"{env} (from ${COMMIT_ENV})", False
    git = ["git", "-c", "safe.directory=*"]
    try:
        commit = subprocess.run(
            [*git, "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                [*git, "status", "--porcelain", "--untracked-files=no"],
                cwd=root,
                capture_output=True,
                text=True,
                check=True,
                timeout=10,
            ).stdout.strip()
        )
        return commit, dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown", False


def nvml_host_facts() -> tuple[str | None, int | None]:
    """(driver version, number of GPUs on the host) from NVML; (None, None) where there is no NVIDIA driver.

    The count is the host's, not the process's: a suite job pinned to one GPU of a two-GPU runner still says 2,
    so a report tells whether a neighbour job could have shared the host.
    """
    try:
        import pynvml
    except ImportError:
        return None, None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no NVIDIA driver here: the report says None
        return None, None
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        return (version.decode() if isinstance(version, bytes) else version), pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()


CUPY_DISTRIBUTIONS = ("cupy-cuda13x", "cupy-cuda12x", "cupy")


def package_environment() -> Environment:
    """The environment as far as it is known without importing torch or CuPy: the packages' installed versions
    (not whether they import), git and NVML; no GPU properties, no CUDA version. What the controlling process of a run
    spread over workers records until its first worker hands over its own ``collect_environment`` (it runs no test,
    and importing torch there cost 4.1-4.6 s of a fresh H100 runner's quick tier, reports/README.md, issue 34)."""
    commit, dirty = git_state()
    driver, host_gpus = nvml_host_facts()
    cupy = next(filter(None, map(_dist_version, CUPY_DISTRIBUTIONS)), None)
    return Environment(
        gpu_name=None,
        compute_capability=None,
        gpu_memory_gib=None,
        driver=driver,
        cuda=None,
        torch=_dist_version("torch") or "not installed",
        cupy=cupy,
        nvmath=_dist_version("nvmath-python"),
        transformers=_dist_version("transformers"),
        peft=_dist_version("peft"),
        python=platform.python_version(),
        git_commit=commit,
        git_dirty=dirty,
        hostname=platform.node(),
        timestamp_utc=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        host_gpus=host_gpus,
    )


def collect_environment() -> Environment:
    """The environment as a test process sees it: ``package_environment`` with torch's view of the GPU and its CUDA
    version, and CuPy and nvmath as they import (None where they do not)."""
    import torch  # here, not at module level: the command line reads reports without importing torch

    from lora_core.ops.cupy_interop import cublas_binding_version, cupy_version

    gpu = cc = mem = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        gpu, cc, mem = props.name, f"{props.major}.{props.minor}", round(props.total_memory / 2**30, 2)
    return dataclasses.replace(
        package_environment(),
        gpu_name=gpu,
        compute_capability=cc,
        gpu_memory_gib=mem,
        cuda=torch.version.cuda,
        torch=torch.__version__,
        cupy=cupy_version(),
        nvmath=cublas_binding_version(),
    )
