"""Measurement: NVML, memory estimate and leak fit, timing, device time, wall time, criteria."""
