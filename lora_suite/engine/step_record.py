"""What one optimizer step of the trainer (``lora_suite.engine.trainer``) records, and how its readings are taken.

Each step records loss, gradient norm, learning rate, tokens/s, host step time, GPU step time (CUDA events around
the step on the current stream) and memory (torch allocated / reserved / peak; this process's own GPU memory,
``process_gpu_mib``, from NVML's per-process accounting or this process's allocators, the source fixed for the run
and kept in ``TrainResult.process_memory_source``; NVML's device-wide used memory, every process's, as context).

Host CPU time: each record also carries the process CPU time of the step (``time.process_time``, all
threads, the autograd engine's included). A loaded host preempts the process and stretches the step's wall
time and event span (2x within one run, seen on an H100 under load); CPU time does not count the time the
process waits for a core. It does count the host's own work and the time it spins in CUDA
synchronisations (CUDA's default schedule spins while there are fewer GPU contexts than cores), so more
GPU work per step shows in it too. A fixed host probe after the step (``host_probe``) tells the host's own speed
apart from more work per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from lora_suite.measure.device_time import DeviceTimer
from lora_suite.measure.memory import MIB, host_heap_bytes, host_rss_bytes
from lora_suite.measure.nvml import NvmlReader, ProcessMemory
from lora_suite.settings.config import TrainSettings


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens_per_s: float
    step_time_s: float  # host wall time of the whole step (synchronised at its end)
    allocated_mib: float
    reserved_mib: float
    peak_allocated_mib: float
    nvml_used_mib: float | None
    gpu_time_s: float | None = None  # CUDA-event time from the step's first launch to its last (None on CPU)
    cpu_time_s: float | None = None  # process CPU time of the step, all threads (module docstring)
    host_probe_s: float | None = None  # process CPU time of the fixed host probe run after the step (host_probe)
    captured: bool = False  # replayed from the captured CUDA graph (train.cuda_graph)
    host_rss_mib: float | None = None  # the process's resident set size after the step (memory.host_rss_bytes)
    host_heap_mib: float | None = None  # C heap in use after the step (memory.host_heap_bytes): the host leak series
    # Summed duration of the step's GPU launches, for the steps a DeviceTimer profiled (lora_suite.measure.device_time)
    device_time_s: float | None = None
    # This process's own GPU memory (lora_suite.measure.nvml.ProcessMemory): the leak series; nvml_used_mib is the
    # whole device's, a neighbour's allocations included, and only context
    process_gpu_mib: float | None = None

    @property
    def profiled(self) -> bool:
        return self.device_time_s is not None


def host_probe(ops: int) -> float:
    """Process CPU time of ``ops`` in-place adds on a 16-element CPU tensor: a fixed amount of the same kind of
    host work a step's Python and dispatch do, so that the host's own speed (clock, a neighbour's load on
    shared cores and caches) can be told apart from more work per step (criteria.host_normalised_drift)."""
    t = torch.zeros(16)
    c0 = time.process_time()
    for _ in range(ops):
        t.add_(1.0)
    return time.process_time() - c0


def step_readings(
    settings: TrainSettings,
    step: int,
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None,
    *,
    nvml: NvmlReader | None,
    process_memory: ProcessMemory | None,
    device_timer: DeviceTimer | None,
) -> dict[str, Any]:
    """A step record's readings once the step has synchronised, taken in this order: the host probe, NVML's and
    this process's GPU memory, the host's RSS and heap, the profiled launches, torch's memory, and the GPU span
    between the step's CUDA ``events`` (None on the CPU, where the memory readings are 0)."""
    cuda = events is not None
    probe = host_probe(settings.host_probe_ops) if settings.host_probe_ops else None
    nvml_used = nvml.used() if nvml is not None else None
    own = process_memory.read() if nvml is not None and process_memory is not None else None
    rss, heap = host_rss_bytes(), host_heap_bytes()
    launches = device_timer.launches.get(step) if device_timer else None
    return {
        "allocated_mib": torch.cuda.memory_allocated() / MIB if cuda else 0.0,
        "reserved_mib": torch.cuda.memory_reserved() / MIB if cuda else 0.0,
        "peak_allocated_mib": torch.cuda.max_memory_allocated() / MIB if cuda else 0.0,
        "nvml_used_mib": None if nvml_used is None else nvml_used / MIB,
        "gpu_time_s": events[0].elapsed_time(events[1]) / 1e3 if events is not None else None,
        "host_probe_s": probe,
        "host_rss_mib": None if rss is None else rss / MIB,
        "host_heap_mib": None if heap is None else heap / MIB,
        "device_time_s": None if launches is None else sum(d for _, d in launches) / 1e6,
        "process_gpu_mib": None if own is None else own / MIB,
    }
