"""The run's header lines (pytest's report header): the GPU, the implementation under test, versions and commit.

A process that runs tests states the GPU and CUDA as torch sees them. The controlling process of a run spread over
workers imports no torch (``harness/worker_records.py``): it states what NVML counts on the host, and the packages'
installed versions; the report holds the first worker's own reading.
"""

from __future__ import annotations

from lora_suite.settings.environment import Environment


def header_lines(env: Environment, implementation: str, *, drives_workers: bool) -> list[str]:
    cuda = "CUDA: see the workers" if drives_workers else (f"CUDA {env.cuda}" if env.cuda else "a CPU build")
    if drives_workers:
        gpus = "no NVIDIA driver" if env.host_gpus is None else f"{env.host_gpus} GPU(s), driver {env.driver}"
        gpu = f"NVML: {gpus} on the host; the GPU and CUDA as the workers see them are in the report"
    elif env.gpu_name is None:
        gpu = "no CUDA GPU found (torch.cuda.is_available() is False): tests marked 'gpu' will be skipped"
    else:
        gpu = f"GPU {env.gpu_name} (sm {env.compute_capability}, {env.gpu_memory_gib} GiB, driver {env.driver})"
    return [
        f"lora-gpu-suite: {gpu}",
        f"lora-gpu-suite: LoRA implementation under test: {implementation}",
        f"lora-gpu-suite: torch {env.torch} ({cuda}), cupy {env.cupy or 'not installed'}, nvmath "
        f"{env.nvmath or 'not installed'}, transformers {env.transformers}, peft {env.peft or 'not installed'}, commit "
        f"{env.git_commit[:12]}{' (dirty)' if env.git_dirty else ''}",
    ]
