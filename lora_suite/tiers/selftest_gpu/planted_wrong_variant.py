"""A pytest plugin that plants a wrong SwiGLU variant choice (never shipped code).

    PYTHONPATH=.:lora_suite/tiers/selftest_gpu python -m lora_suite quick -- -p planted_wrong_variant

The launcher takes 16-byte vectors whenever I is a multiple of 4 instead of a multiple of the vector width: for
fp32 that is the same rule, for bf16 and fp16 activations with I ≡ 4 (mod 8) each row's u half starts 8 bytes
off a 16-byte boundary and the last 4 elements of a row fall outside the whole vectors. The quick tier must fail on
it (tiers/selftest_gpu/test_planted_wrong_variant.py runs it and asserts so).
"""

from __future__ import annotations

from lora_core.ops import fused_engine


def _vectors_whenever_four_divide(dtype, inter: int) -> int:
    return fused_engine._SWIGLU_VEC[dtype] if inter % 4 == 0 else 1


def pytest_configure(config):
    fused_engine._swiglu_vec = _vectors_whenever_four_divide
