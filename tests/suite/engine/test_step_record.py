"""A step record's readings on the CPU (``lora_suite/engine/step_record.py``): no GPU, no NVML, the host's own."""

from __future__ import annotations

from lora_suite.engine.step_record import StepRecord, host_probe, step_readings
from lora_suite.settings.config import TrainSettings


def test_readings_on_the_cpu_have_no_device_side():
    r = step_readings(TrainSettings(), 3, None, nvml=None, process_memory=None, device_timer=None)
    assert r["allocated_mib"] == r["reserved_mib"] == r["peak_allocated_mib"] == 0.0
    assert r["nvml_used_mib"] is r["gpu_time_s"] is r["process_gpu_mib"] is r["device_time_s"] is None
    assert r["host_probe_s"] is None  # host_probe_ops 0: off
    rec = StepRecord(**r, step=3, loss=1.0, grad_norm=1.0, lr=1e-4, tokens_per_s=1.0, step_time_s=0.1)
    assert not rec.profiled and rec.step == 3


def test_the_host_probe_runs_when_asked():
    r = step_readings(TrainSettings(host_probe_ops=100), 0, None, nvml=None, process_memory=None, device_timer=None)
    assert r["host_probe_s"] is not None and r["host_probe_s"] >= 0.0
    assert host_probe(10) >= 0.0
