"""NVML readings without a GPU: every reading is None, never an exception."""

from __future__ import annotations

import pytest
import torch

from lora_suite.measure.nvml import NvmlReader, nvml_memory


def test_nvml_without_gpu_is_none():
    if torch.cuda.is_available():
        pytest.skip("this checks the no-GPU answer")
    assert nvml_memory() is None
    reader = NvmlReader()
    assert reader.memory() is None and reader.used() is None
    reader.close()


class _FakeNvml:
    """The slice of pynvml that per-process accounting reads."""

    class NVMLError(Exception):
        pass

    def __init__(self, procs):
        self.procs = procs

    def nvmlDeviceGetComputeRunningProcesses(self, handle):  # noqa: N802  (pynvml's name)
        if isinstance(self.procs, Exception):
            raise self.procs
        return self.procs


def _reader(procs):
    from types import SimpleNamespace

    reader = NvmlReader.__new__(NvmlReader)
    reader._nvml, reader._handle = _FakeNvml(procs), object()
    return reader, SimpleNamespace


def test_process_memory_is_this_pids_share_not_the_devices():
    """Issue 28: a neighbour on the same GPU moved the device-wide reading; the per-process one is this PID's."""
    import os

    from lora_suite.measure.nvml import process_memory

    reader, proc = _reader(None)
    reader._nvml.procs = [
        proc(pid=os.getpid() + 1, usedGpuMemory=40 << 30),
        proc(pid=os.getpid(), usedGpuMemory=3 << 30),
    ]
    assert reader.process_used() == 3 << 30
    assert process_memory(reader) == (3 << 30, "NVML per-process")
    reader._nvml.procs = [proc(pid=os.getpid(), usedGpuMemory=None)]  # accounting not available
    assert reader.process_used() is None
    reader._nvml.procs = [proc(pid=os.getpid(), usedGpuMemory=2**64 - 1)]  # NVML_VALUE_NOT_AVAILABLE
    assert reader.process_used() is None
    reader._nvml.procs = reader._nvml.NVMLError("not supported")
    assert reader.process_used() is None
    if not torch.cuda.is_available():
        assert process_memory(reader) == (None, "no GPU")


def test_process_memory_falls_back_to_this_processs_allocators_and_says_so(monkeypatch):
    """Where NVML shows no entry for the PID (a container's PID namespace): torch's reserved memory plus CuPy's pool."""
    import sys
    from types import SimpleNamespace

    from lora_suite.measure.nvml import process_memory

    reader, _ = _reader([])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 5 << 20)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    used, source = process_memory(reader, pid=123)
    assert used == 5 << 20 and source == "torch reserved (NVML shows no entry for PID 123)"
    pool = SimpleNamespace(total_bytes=lambda: 2 << 20)
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(get_default_memory_pool=lambda: pool))
    assert process_memory(reader, pid=123) == (7 << 20, "torch reserved + CuPy pool (NVML shows no entry for PID 123)")


def test_process_memory_keeps_one_source_for_a_whole_run(monkeypatch):
    """A series never mixes NVML's figure (context included) with the allocators': where the chosen source stops
    answering, the reading is None (the leak verdict says so), not the other source's figure."""
    import os
    import sys

    from lora_suite.measure.nvml import ProcessMemory

    reader, proc = _reader([])
    reader._nvml.procs = [proc(pid=os.getpid(), usedGpuMemory=3 << 30)]
    own = ProcessMemory(reader)
    assert own.read() == 3 << 30 and own.source == "NVML per-process"
    reader._nvml.procs = []  # the entry is gone
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 5 << 20)
    assert own.read() is None and own.source == "NVML per-process"
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    fallback = ProcessMemory(reader)
    assert fallback.read() == 5 << 20 and fallback.source.startswith("torch reserved (NVML shows no entry")
    reader._nvml.procs = [proc(pid=os.getpid(), usedGpuMemory=3 << 30)]  # NVML appears later: still the allocators
    assert fallback.read() == 5 << 20
