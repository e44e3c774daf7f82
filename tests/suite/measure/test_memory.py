"""Memory: the LoRA-aware estimate, the --check-vram verdict, the measured split (the leak-slope fit:
test_leak_fit.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lora_suite.engine.prepare import prepare
from lora_suite.engine.trainer import train
from lora_suite.measure.memory import (
    CONTEXT_BYTES,
    GIB,
    MIB,
    MemoryEstimate,
    estimate_training_memory,
    measured_split,
    vram_verdict,
)
from lora_suite.settings.config import AdapterSpec
from tests.conftest import TINY_ARCH


def test_estimate_by_hand_for_the_tiny_llama():
    lora = AdapterSpec(targets=("q_proj", "v_proj"), r=4, adapter_dtype="float32")
    est = estimate_training_memory(TINY_ARCH, lora, batch_size=2, seq_len=8, gradient_checkpointing=False)
    h, i, kv, layers, v = 64, 128, 32, 2, 300
    linear = layers * (h * h + h * kv + h * kv + h * h + 3 * h * i)
    other = 2 * v * h + (2 * layers + 1) * h
    adapter = layers * 4 * ((h + h) + (h + kv))
    assert est.weights == (linear + other) * 2
    assert (est.adapters, est.gradients, est.optimizer) == (adapter * 4, adapter * 4, adapter * 8)
    assert est.activations == 16 * layers * (20 * h + 8 * i) and est.logits == 16 * v * 14
    assert est.allocated_peak == sum(x for k, x in dataclasses.asdict(est).items() if k != "context")


def test_checkpointing_and_nf4_shrink_the_estimate():
    lora = AdapterSpec(targets=("all-linear",), r=16)
    base = dict(batch_size=1, seq_len=512)
    plain = estimate_training_memory(TINY_ARCH, lora, gradient_checkpointing=False, **base)
    ckpt = estimate_training_memory(TINY_ARCH, lora, gradient_checkpointing=True, **base)
    nf4 = estimate_training_memory(
        TINY_ARCH, dataclasses.replace(lora, quantize="nf4"), gradient_checkpointing=True, **base
    )
    assert ckpt.activations < plain.activations and nf4.weights < ckpt.weights and nf4.quant_state > 0
    assert nf4.dequant_scratch == 128 * 64 * 2


def test_vram_verdict_gives_need_and_free():
    est = MemoryEstimate(
        weights=GIB, quant_state=0, adapters=0, gradients=0, optimizer=0, activations=GIB, logits=0, dequant_scratch=0
    )
    ok, msg = vram_verdict(est, 10 * GIB)
    assert ok and "need ~2.80 GiB" in msg and "NVML free 10.00 GiB: enough" in msg
    ok, msg = vram_verdict(est, 2 * GIB)
    assert not ok and "NOT enough" in msg
    ok, msg = vram_verdict(est, 2 * GIB, 60 * GIB)  # a neighbour holds most of the GPU: the pre-check says so
    assert not ok and "NVML free 2.00 GiB (after 60.00 GiB already held on the GPU, other processes' included)" in msg
    assert est.device_need == int(2 * GIB * 1.1) + CONTEXT_BYTES


def test_measured_split_adds_up(tiny_cfg):
    p = prepare(tiny_cfg, "cpu")
    result = train(p.model, p.batches, dataclasses.replace(tiny_cfg.train, steps=2, warmup_steps=0))
    split = measured_split(p.model, result.optimizer, peak_allocated=10**8)
    n_adapters = 2 * 7 * 2  # A and B, 7 linears, 2 layers
    assert split["adapters"] == split["gradients"]
    assert 2 * split["adapters"] <= split["optimizer"] <= 2 * split["adapters"] + 8 * n_adapters  # + a step count each
    assert sum(split.values()) == 10**8


class _FakeAllocator:
    """torch.cuda's counters as PeakWindow reads them; ``workspaces`` bytes go when the workspaces are cleared."""

    def __init__(self, allocated, workspaces, peak):
        self.allocated, self.workspaces, self.peak_bytes, self.calls = allocated, workspaces, peak, []

    def install(self, monkeypatch, with_clear=True):
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: self.calls.append("sync"))
        monkeypatch.setattr(cuda, "empty_cache", lambda: self.calls.append("empty_cache"))
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: self.calls.append("reset"))
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak_bytes)
        if with_clear:
            monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", self.clear, raising=False)
        else:
            monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces", raising=False)

    def clear(self):
        self.calls.append("clear")
        self.allocated -= self.workspaces
        self.workspaces = 0


def test_peak_window_releases_workspaces_and_excludes_what_earlier_work_left(monkeypatch):
    from lora_suite.measure.memory import PeakWindow

    fake = _FakeAllocator(allocated=100 * MIB, workspaces=64 * MIB, peak=14 * GIB)
    fake.install(monkeypatch)
    window = PeakWindow.open()
    assert (window.released, window.carried) == (64 * MIB, 36 * MIB)
    assert fake.calls == ["sync", "clear", "empty_cache", "reset"]  # released before the peak is reset
    assert window.peak() == 14 * GIB - 36 * MIB


def test_peak_window_without_the_workspace_call_releases_nothing(monkeypatch):
    from lora_suite.measure.memory import PeakWindow

    fake = _FakeAllocator(allocated=64 * MIB, workspaces=64 * MIB, peak=GIB)
    fake.install(monkeypatch, with_clear=False)
    window = PeakWindow.open()
    assert (window.released, window.carried, window.peak()) == (0, 64 * MIB, GIB - 64 * MIB)


def test_host_heap_in_use_sees_a_leak_that_reuses_freed_memory():
    """The RSS misses a leak served from memory the process freed earlier (glibc keeps it); bytes in use do not."""
    import sys

    from lora_suite.measure.memory import host_heap_bytes, host_rss_bytes

    if host_heap_bytes() is None:
        pytest.skip(f"no glibc mallinfo2 on this platform ({sys.platform})")
    churn = [bytearray(1 << 20) for _ in range(64)]
    del churn  # 64 MiB freed: glibc may keep it for reuse
    before = host_heap_bytes()
    kept = [bytearray(1 << 20) for _ in range(16)]
    grown = host_heap_bytes() - before
    assert 15 * 2**20 <= grown <= 20 * 2**20, grown
    assert host_rss_bytes() > 0 and len(kept) == 16


def test_host_rss_is_none_where_there_is_no_statm(tmp_path):
    from lora_suite.measure.memory import host_rss_bytes

    assert host_rss_bytes(str(tmp_path / "missing")) is None
    (tmp_path / "statm").write_text("garbage")
    assert host_rss_bytes(str(tmp_path / "statm")) is None
