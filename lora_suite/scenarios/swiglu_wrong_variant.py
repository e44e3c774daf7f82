"""A planted wrong SwiGLU kernel-variant choice: a pytest plugin, never shipped code.

    lora-suite quick -- -p lora_suite.scenarios.swiglu_wrong_variant

The launcher takes 16-byte vectors whenever I is a multiple of 4 instead of a multiple of the vector width: for
fp32 that is the same rule, for bf16 and fp16 activations with I ≡ 4 (mod 8) each row's u half starts 8 bytes
off a 16-byte boundary and the last 4 elements of a row fall outside the whole vectors. The quick tier must fail on
it (selftest-gpu's ``test_planted_wrong_variant.py`` runs it and asserts so). Until issue 58 this was
``tiers/selftest_gpu/planted_wrong_variant.py``, loaded from that folder through ``PYTHONPATH``.
"""

from __future__ import annotations

import torch

from lora_core.ops import fused_engine


def vectors_whenever_four_divide(dtype: torch.dtype, inter: int) -> int:
    """The wrong choice: the dtype's 16-byte vector width when 4 divides I (the right rule: when the width does)."""
    return fused_engine._SWIGLU_VEC[dtype] if inter % 4 == 0 else 1


def pytest_configure(config) -> None:
    fused_engine._swiglu_vec = vectors_whenever_four_divide
