"""Parity helpers on the CPU: tolerances, error metrics, and the float64 reference itself."""

from __future__ import annotations

import math

import torch

from lora_suite.judges.parity import UNIT_ROUNDOFF, compare, parity, random_case, tolerance


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
    case = random_case(
        (2, 5), 96, 40, 4, torch.float32, torch.float32, "cpu", generator=torch.Generator().manual_seed(0)
    )
    x, w, a, b, dy = case
    errs = parity(x, w, a, b, 2.0, dy, backend="torch")
    assert [e.name for e in errs] == ["y", "dx", "dA", "dB"] and all(e.ok for e in errs), [e.describe() for e in errs]


def test_float64_reference_is_the_formula_and_agrees_with_autograd():
    """The reference no longer calls lora_linear_torch (the code under test supplied its own yardstick);
    here float64 autograd through plain F.linear checks the hand-written formula."""
    import inspect

    import lora_suite.judges.parity as P

    assert "lora_linear_torch(" not in inspect.getsource(P.reference_f64)
    gen = torch.Generator().manual_seed(1)
    x, w, a, b, dy = random_case((3, 7), 33, 21, 5, torch.float64, torch.float64, "cpu", generator=gen)
    y, dx, da, db = P.reference_f64(x, w, a, b, 1.5, dy)
    x1, a1, b1 = (t.detach().clone().requires_grad_() for t in (x, a, b))
    y1 = torch.nn.functional.linear(x1, w) + 1.5 * torch.nn.functional.linear(torch.nn.functional.linear(x1, a1), b1)
    y1.backward(dy)
    for got, ref in ((y, y1), (dx, x1.grad), (da, a1.grad), (db, b1.grad)):
        torch.testing.assert_close(got, ref.detach(), rtol=1e-12, atol=1e-12)


def test_a_wrong_torch_backend_is_caught_by_the_formula_reference(monkeypatch):
    """With the old reference (autograd of lora_linear_torch) a bug there moved candidate and yardstick alike."""
    from lora_core.ops import lora_linear as op

    real = op.lora_linear_torch
    monkeypatch.setattr(op, "lora_linear_torch", lambda x, w, a, b, s: real(x, w, a, b, 2 * s))  # scale doubled
    x, w, a, b, dy = random_case(
        (2, 5), 96, 40, 4, torch.float32, torch.float32, "cpu", generator=torch.Generator().manual_seed(0)
    )
    assert not all(e.ok for e in parity(x, w, a, b, 2.0, dy, backend="torch"))


def test_a_grid_row_names_the_tensor_worst_against_its_tolerance_and_every_failure():
    from lora_suite.judges.parity import GRID_COLUMNS, TensorError, grid_row

    good = TensorError("y", 1e-4, 1.0, 1e-4, 1e-3, 0, (0,))
    bad = TensorError("dA", 5e-3, 1.0, 5e-3, 2e-3, 7, (1, 2))
    row, failures = grid_row("N=4", [good, bad])
    assert len(row) == len(GRID_COLUMNS) and row == ("N=4", "dA", 5e-3, 2e-3, "FAIL")
    assert failures == [f"N=4: {bad.describe()}"]
    assert grid_row("N=4", [good]) == (("N=4", "y", 1e-4, 1e-3, "ok"), [])
