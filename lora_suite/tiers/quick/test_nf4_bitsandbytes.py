"""The NF4 kernel's branch for weights read from bitsandbytes, on the GPU, against bitsandbytes' own
``dequantize_4bit`` (issue 28: it was checked only against the CPU reference on a recorded fixture).

A weight quantised by bitsandbytes as QLoRA runs it (nf4, block 64, nested absmax through its 8-bit dynamic map
plus an fp32 offset) is read by ``lora_core.bnb_format.from_bnb`` and dequantised by lora_core's RawKernel; every
element must equal ``bitsandbytes.functional.dequantize_4bit``'s bit for bit (the same codes and the same fp32
arithmetic: code2[q]·absmax2 + offset, then code·absmax rounded once). The cases cover the three weight dtypes, a
last nested block that is only partly filled (999 absmaxes: 3 full blocks of 256 and one of 231), zero blocks,
a block dominated by one huge value, and a weight whose absmaxes straddle the offset.

Runs in ``quick`` where bitsandbytes imports (``pip install lora-gpu-suite[peft-bnb]``); skipped, saying so,
where it does not. selftest-gpu plants a dropped offset and a wrong absmax map here
(tiers/selftest_gpu/test_planted_bnb_defects.py) and asserts that this check fails on each.
"""

from __future__ import annotations

import pytest
import torch

from lora_core.bnb_format import from_bnb
from lora_core.nf4 import NF4Tensor, dequantize_nf4

pytestmark = [pytest.mark.gpu, pytest.mark.quick, pytest.mark.needs_feature("lora_core_ops")]


def _adversarial(dtype, gen) -> torch.Tensor:
    w = torch.randn(96, 256, device="cuda", generator=gen) * 0.02
    w[0, :64] = 0.0  # an all-zero block
    w[1, 64:128] = 0.0
    w[1, 70] = 1e4  # one huge value: the rest of its block collapses to code 7
    w[2, :64] = -3.0  # a constant block
    w[40:] *= 50.0  # absmaxes far above and below their mean (the offset)
    return w.to(dtype)


CASES = {
    "random-bf16-4096x4096": lambda g: (torch.randn(4096, 4096, device="cuda", generator=g) * 0.02).bfloat16(),
    "random-fp16-1000x64": lambda g: torch.randn(1000, 64, device="cuda", generator=g).half(),
    "random-fp32-333x192-partial-nested-block": lambda g: torch.randn(333, 192, device="cuda", generator=g) * 3,
    "adversarial-bf16": lambda g: _adversarial(torch.bfloat16, g),
    "adversarial-fp32": lambda g: _adversarial(torch.float32, g),
}


def bnb_case(name: str):
    """(packed codes, bitsandbytes QuantState) of case ``name``, quantised by bitsandbytes as QLoRA runs it."""
    import bitsandbytes.functional as F

    w = CASES[name](torch.Generator(device="cuda").manual_seed(2028))
    return F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")


def differing(packed, state, read=from_bnb) -> tuple[int, int, float]:
    """(elements differing, elements, largest |difference|) between lora_core's dequantisation of the state as
    ``read`` holds it and bitsandbytes' ``dequantize_4bit``."""
    import bitsandbytes.functional as F

    q: NF4Tensor = read(packed, state)
    ours, theirs = dequantize_nf4(q), F.dequantize_4bit(packed, state)
    diff = (ours.float() - theirs.float()).abs()
    return int((ours != theirs).sum()), ours.numel(), float(diff.max())


@pytest.mark.parametrize("name", list(CASES))
def test_bitsandbytes_state_dequantises_bitwise_as_bitsandbytes(name, check):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: pip install lora-gpu-suite[peft-bnb]")
    packed, state = bnb_case(name)
    check(
        f"{name}: nested absmax form (bitsandbytes' 8-bit map + offset) read",
        state.nested,
        "==",
        True,
        source="compress_statistics=True, as BitsAndBytesConfig(bnb_4bit_use_double_quant=True)",
    )
    n_diff, n, worst = differing(packed, state)
    check(
        f"{name}: elements of lora_core's dequantisation differing from bitsandbytes.dequantize_4bit",
        n_diff,
        "==",
        0,
        source="bitwise: the same codes and the same fp32 arithmetic (lora_core/bnb_format.py)",
        detail=f"{n} elements, largest |difference| {worst:.3g}",
    )
