"""lora_suite.harness.recompute_reuse: a tier that trains lora_core's cupy layers on an NF4 base with checkpointing
checks that the backward reused the bases the recompute dequantised (lora_core.ops.recompute), and only then."""

from __future__ import annotations

import types

import pytest

from lora_suite.harness import recompute_reuse as RR
from lora_suite.implementations import resolve_implementation


def _cfg(quantize, ckpt):
    return types.SimpleNamespace(
        lora=types.SimpleNamespace(quantize=quantize), train=types.SimpleNamespace(gradient_checkpointing=ckpt)
    )


def _prepared(impl, quantize):
    return types.SimpleNamespace(implementation=resolve_implementation(impl), quantize=quantize)


@pytest.mark.parametrize(
    ("impl", "quantize", "ckpt", "expected"),
    [
        ("cupy", "nf4", True, True),
        ("cupy-fused", "nf4", True, True),
        ("cupy", "nf4", False, False),  # no recompute: nothing to reuse
        ("cupy", None, True, False),  # a 16-bit base is stored, not dequantised
        ("torch", "nf4", True, False),  # lora_core's reference backend keeps autograd's own copy
        ("peft", "nf4", True, False),  # another implementation: lora_core's path is not its own
    ],
)
def test_the_reuse_is_checked_where_lora_cores_cupy_layers_recompute_an_nf4_base(impl, quantize, ckpt, expected):
    assert RR.applies(_prepared(impl, quantize), _cfg(quantize, ckpt)) is expected


def test_an_nf4_tiers_16bit_comparison_run_is_not_checked():
    """The full and memory tiers also train their configuration on a 16-bit base (the QLoRA-saves-memory check);
    that run dequantises nothing, so its reuse is not checked, though its config says nf4 (seen on an H100: the
    check failed there with 0 bases kept)."""
    assert RR.applies(_prepared("cupy", None), _cfg("nf4", True)) is False
    assert RR.applies(_prepared("cupy", "nf4"), _cfg("nf4", True)) is True


class _Check:
    def __init__(self):
        self.rows = []

    def __call__(self, what, value, op, threshold, source=""):
        ok = {">": value > threshold, "==": value == threshold}[op]
        self.rows.append((what, value, op, threshold, ok))


@pytest.mark.parametrize(
    ("now", "failing"),
    [
        ({"kept": 70, "taken": 70, "dropped": 0}, []),
        ({"kept": 10, "taken": 10, "dropped": 0}, ["kept for their backward"]),  # nothing kept in this run
        ({"kept": 70, "taken": 66, "dropped": 4}, ["taken by their backward", "dropped untaken"]),
    ],
)
def test_the_reuse_check_fails_when_nothing_was_kept_or_a_kept_base_was_not_taken(now, failing, monkeypatch):
    monkeypatch.setattr(RR, "counts", lambda: now)
    check = _Check()
    RR.check(check, "full", {"kept": 10, "taken": 10, "dropped": 0})
    failed = [what for what, *_, ok in check.rows if not ok]
    assert len(check.rows) == 3
    assert [f for f in failing if not any(f in w for w in failed)] == [] and len(failed) == len(failing)


def test_the_tier_checks_around_a_run_only_where_the_path_applies_and_the_run_finished(monkeypatch):
    seen = {"n": 0}

    def counts():
        seen["n"] += 1
        return {"kept": 5 * seen["n"], "taken": 5 * seen["n"], "dropped": 0}

    monkeypatch.setattr(RR, "counts", counts)
    cupy = _prepared("cupy", "nf4")
    check = _Check()
    with RR.checked(check, "memory", cupy, _cfg("nf4", True)):
        pass
    assert [ok for *_, ok in check.rows] == [True, True, True]
    with RR.checked(check, "memory", _prepared("cupy", None), _cfg("nf4", True)):  # a 16-bit base: nothing to check
        pass
    with pytest.raises(RuntimeError), RR.checked(check, "memory", cupy, _cfg("nf4", True)):
        raise RuntimeError("the run stopped")  # its own error is the finding, not a missing reuse
    assert len(check.rows) == 3
