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
