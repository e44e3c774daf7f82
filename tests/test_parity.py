"""Parity helpers on the CPU: tolerances, error metrics, and the float64 reference itself."""

from __future__ import annotations

import math

import torch

from lora_core.parity import UNIT_ROUNDOFF, compare, parity, random_case, tolerance


def test_tolerance_is_c_times_unit_roundoff():
    assert tolerance(torch.bfloat16, 1) == 8 * (2.0**-8 + 2.0**-24)
    assert tolerance(torch.float32, 4096) == 8 * (2.0**-24 + 2.0**-24 * 64)
    assert UNIT_ROUNDOFF[torch.float16] == 2.0**-11


def test_compare_reports_where_and_how_many():
    ref = torch.zeros(3, 4, dtype=torch.float64)
    ref[0, 0] = 2.0
    out = ref.clone().float()
    out[2, 1] = 0.5
    e = compare("y", out, ref, tol=0.1)
    assert (e.max_abs_err, e.scaled_err, e.worst_index, e.n_bad, e.ok) == (0.5, 0.25, (2, 1), 1, False)
    out[1, 1] = float("nan")
    assert math.isinf(compare("y", out, ref, tol=0.1).max_abs_err)  # NaN counts as the worst error


def test_torch_backend_in_fp32_is_within_its_tolerance_on_cpu():
    case = random_case((2, 5), 96, 40, 4, torch.float32, torch.float32, "cpu", generator=torch.Generator().manual_seed(0))
    x, w, a, b, dy = case
    errs = parity(x, w, a, b, 2.0, dy, backend="torch")
    assert [e.name for e in errs] == ["y", "dx", "dA", "dB"] and all(e.ok for e in errs), [e.describe() for e in errs]
