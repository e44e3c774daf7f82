"""selftest-gpu, the mixed-input NF4 GEMM (``lora_core.ops.nf4_matmul``): each test plants one defect in how it is
called (a wrapper or a patched helper here, never shipped code) and asserts that the quick tier's checks
(tiers/quick/test_nf4_matmul_kernel.py) fail on it, on at least one absmax form and shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_suite.harness.modules import load_test_module

pytestmark = [pytest.mark.gpu, pytest.mark.selftest_gpu]
QUICK = Path(__file__).resolve().parents[1] / "quick" / "test_nf4_matmul_kernel.py"


def _plants():
    from lora_core.ops import nf4_matmul as NM

    def wrong_form(x, q, out=None):  # bitsandbytes' nested absmaxes read as lora_core's int8 codes (map ignored)
        real = NM.absmax_form
        NM.absmax_form = lambda q: {"dcode": "int8"}.get(real(q), real(q))
        try:
            return NM.nf4_matmul(x, q, out=out)
        finally:
            NM.absmax_form = real

    def last_tile_dropped(x, q, out=None):  # the grid rounded down: a ragged last row block never computed
        y = NM.nf4_matmul(x, q, out=out)
        rows = x.shape[0] // 128 * 128
        if rows < x.shape[0]:
            y[rows:] = 0
        return y

    return {
        "lookup": ("the code lookup left out (the benchmark's timing bound)", NM.bound_matmul),
        "form": ("bitsandbytes' nested absmaxes read without their map", wrong_form),
        "tile": ("the ragged last row block not computed", last_tile_dropped),
    }


@pytest.mark.parametrize("plant", ["lookup", "form", "tile"])
def test_a_wrong_nf4_matmul_is_caught(plant, check):
    pytest.importorskip("triton", reason="lora_core.ops.nf4_matmul is a Triton kernel; triton is not installed")
    quick = load_test_module(QUICK, "nf4_matmul_plant")
    name, fn = _plants()[plant]
    caught = []
    for form in quick.FORMS:
        if quick.identity_mismatches(fn, form, torch.bfloat16) > 0:
            caught.append(f"{form}: I·Ŵᵀ")
        for m, n, k in quick.SHAPES:
            e, untouched = quick.slice_errors(fn, form, m, n, k)
            if not e.ok or not untouched:
                caught.append(f"{form} {m}x{n}x{k}: {e.describe()}")
    check(f"planted {name}: quick checks that fail", len(caught), ">", 0, detail="; ".join(caught)[:600])
