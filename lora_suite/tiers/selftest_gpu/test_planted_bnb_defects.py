"""selftest-gpu, the NF4 kernel's bitsandbytes branch: each test plants one defect in how lora_core holds a state
read from bitsandbytes (a wrapper around ``from_bnb`` here, never shipped code) and asserts that the quick tier's
check against bitsandbytes' own ``dequantize_4bit`` (tiers/quick/test_nf4_bitsandbytes.py) fails on it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from lora_core.bnb_format import from_bnb
from lora_suite.harness.modules import load_test_module

pytestmark = [pytest.mark.gpu, pytest.mark.selftest_gpu]
QUICK = Path(__file__).resolve().parents[1] / "quick" / "test_nf4_bitsandbytes.py"

PLANTS = {
    # the offset (the mean subtracted before the absmaxes were quantised) not added back
    "offset dropped": lambda q: dataclasses.replace(q, absmax_mean=0.0),
    # the nested absmaxes read through a linear 8-bit map instead of bitsandbytes' dynamic one
    "linear map for the nested absmaxes": lambda q: dataclasses.replace(
        q, absmax_code=torch.linspace(-1.0, 1.0, 256, device=q.device)
    ),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_wrong_bitsandbytes_absmax_is_caught(plant, check):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: pip install lora-gpu-suite[peft-bnb]")
    quick = load_test_module(QUICK, "nf4_bitsandbytes_plant")
    for case in ("random-bf16-4096x4096", "adversarial-bf16"):
        packed, state = quick.bnb_case(case)
        n_diff, n, worst = quick.differing(packed, state, read=lambda p, s: PLANTS[plant](from_bnb(p, s)))
        check(
            f"planted {plant}, {case}: elements differing from bitsandbytes.dequantize_4bit",
            n_diff,
            ">",
            0,
            source="quick tier's bitsandbytes check (tiers/quick/test_nf4_bitsandbytes.py)",
            detail=f"{n} elements, largest |difference| {worst:.3g}",
        )
