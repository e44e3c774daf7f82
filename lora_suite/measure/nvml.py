"""NVML readings of the GPU torch uses: total, free and used memory (device-wide, all processes).

The device is matched by UUID (falling back to the PCI bus id), so ``CUDA_VISIBLE_DEVICES`` is respected.
Without a GPU, or without nvidia-ml-py (module ``pynvml``), every reading is None.
"""

from __future__ import annotations

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
    bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
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
        if self._handle is None:
            return None
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return GpuMemory(total=int(info.total), free=int(info.free), used=int(info.used))

    def used(self) -> int | None:
        mem = self.memory()
        return None if mem is None else mem.used

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = self._handle = None


def nvml_memory(device_index: int | None = None) -> GpuMemory | None:
    """Total / free / used bytes of torch's CUDA device as NVML sees them; None without a GPU or NVML."""
    reader = NvmlReader(device_index)
    try:
        return reader.memory()
    finally:
        reader.close()
