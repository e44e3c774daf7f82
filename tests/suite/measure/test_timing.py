"""Timing statistics (the CUDA-event timing itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from lora_suite.measure.timing import TimingStats, cuda_time


def test_stats_median_and_quantiles():
    s = TimingStats.from_samples([5.0, 1.0, 2.0, 4.0, 3.0])
    assert (s.median_ms, s.p20_ms, s.p80_ms, s.mean_ms, s.reps) == (3.0, 1.8, 4.2, 3.0, 5)
    with pytest.raises(ValueError, match="no timing samples"):
        TimingStats.from_samples([])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_time_without_gpu_says_so():
    with pytest.raises(RuntimeError, match="cuda_time needs a CUDA GPU"):
        cuda_time(lambda: None)
