"""NVML readings of the GPU torch uses: total, free and used memory (device-wide, all processes), and this process's
own share (``process_memory``: NVML's per-process accounting, or this process's allocators where NVML has no entry).

The device is matched by UUID (falling back to the PCI bus id), so ``CUDA_VISIBLE_DEVICES`` is respected.
Without a GPU, or without nvidia-ml-py (module ``pynvml``), every reading is None.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GpuMemory:
    total: int
    free: int
    used: int


def _nvml_handle(pynvml, device_index: int):
    """The NVML handle of torch's device ``device_index`` (UUID match: respects CUDA_VISIBLE_DEVICES)."""
    props = torch.cuda.get_device_properties(device_index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(text if text.startswith("GPU-") else f"GPU-{text}")
    # torch's stub of _CudaDeviceProperties lacks the pci_* fields its C++ binding (torch/csrc/cuda/Module.cpp) sets
    domain = props.pci_domain_id  # type: ignore[attr-defined]  # torch stub lacks it (see above)
    bus_no = props.pci_bus_id  # type: ignore[attr-defined]  # torch stub lacks it (see above)
    device = props.pci_device_id  # type: ignore[attr-defined]  # torch stub lacks it (see above)
    bus = f"{domain:08x}:{bus_no:02x}:{device:02x}.0"
    return pynvml.nvmlDeviceGetHandleByPciBusId(bus)


class NvmlReader:
    """NVML opened once for many readings (a training loop reads every step); a no-op without NVML."""

    def __init__(self, device_index: int | None = None):
        self._nvml = self._handle = None
        if not torch.cuda.is_available():
            return
        try:
            import pynvml
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:
            return
        self._nvml = pynvml
        self._handle = _nvml_handle(pynvml, torch.cuda.current_device() if device_index is None else device_index)

    def memory(self) -> GpuMemory | None:
        if self._nvml is None or self._handle is None:  # both are set together, or neither
            return None
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return GpuMemory(total=int(info.total), free=int(info.free), used=int(info.used))

    def used(self) -> int | None:
        mem = self.memory()
        return None if mem is None else mem.used

    def process_used(self, pid: int | None = None) -> int | None:
        """GPU memory NVML accounts to process ``pid`` (default: this one) on this device; None where NVML shows no
        entry for it (a container's own PID namespace, or per-process accounting not available)."""
        if self._nvml is None or self._handle is None:  # both are set together, or neither
            return None
        pid = os.getpid() if pid is None else pid
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except self._nvml.NVMLError:
            return None
        used = [p.usedGpuMemory for p in procs if p.pid == pid]
        # NVML reports an unknown amount as None (pynvml) or as NVML_VALUE_NOT_AVAILABLE (2**64 - 1)
        return None if not used or used[0] is None or used[0] >= 2**63 else int(used[0])

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = self._handle = None


NVML_PER_PROCESS = "NVML per-process"


def allocators_memory() -> tuple[int | None, str]:
    """(bytes, which allocators) this process's allocators hold on the GPU: torch's reserved memory plus CuPy's
    pool where this process uses CuPy (never imported here). The CUDA context and libraries' own buffers are not
    in it: NVML's per-process figure is the fuller one where it is visible."""
    if not torch.cuda.is_available():
        return None, "no GPU"
    total, parts = torch.cuda.memory_reserved(), ["torch reserved"]
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        total += int(cupy.get_default_memory_pool().total_bytes())
        parts.append("CuPy pool")
    return total, " + ".join(parts)


def process_memory(reader: NvmlReader, pid: int | None = None) -> tuple[int | None, str]:
    """(bytes, where they come from) of this process's GPU memory: NVML's per-process accounting, else torch's
    reserved memory plus CuPy's pool (what this process's allocators hold), saying which. Device-wide usage counts
    every other process on the GPU too: a neighbour's allocations are not this run's."""
    used = reader.process_used(pid)
    if used is not None:
        return used, NVML_PER_PROCESS
    total, parts = allocators_memory()
    if total is None:
        return None, parts
    return total, parts + f" (NVML shows no entry for PID {os.getpid() if pid is None else pid})"


class ProcessMemory:
    """This process's GPU memory read the same way for a whole run: the source is chosen at the first reading
    (``process_memory``) and kept, so that a series never mixes NVML's figure (context included) with the
    allocators' (a switch would look like a step in memory). Where the chosen source stops answering, readings
    are None (the leak verdict then says it had no readings) rather than taken from the other source."""

    def __init__(self, reader: NvmlReader, pid: int | None = None):
        self.reader, self.pid = reader, pid
        self.source: str | None = None

    def read(self) -> int | None:
        if self.source is None:
            used, self.source = process_memory(self.reader, self.pid)
            return used
        if self.source == NVML_PER_PROCESS:
            return self.reader.process_used(self.pid)
        return allocators_memory()[0]


def nvml_memory(device_index: int | None = None) -> GpuMemory | None:
    """Total / free / used bytes of torch's CUDA device as NVML sees them; None without a GPU or NVML."""
    reader = NvmlReader(device_index)
    try:
        return reader.memory()
    finally:
        reader.close()
