"""Issue 56, item 7: ``--oom-retry`` runs a tier test that ran out of memory again with half the micro-batch and twice
the accumulation; its pass is PASS (RETRIED), never PASS; a failed attempt leaves no record; at a micro-batch of 1
the out-of-memory stands. On the CPU, with the real ``Tier`` and the quick tier's YAML (micro-batch 8)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lora_suite.measure.card import OOM_CHECK, RETRIED_CHECK

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[3]
TIER_FIXTURE = """

import pytest


@pytest.fixture
def tier(request, run_report, check, lora_impl):
    from lora_suite.harness.tier import Tier

    return Tier(request, run_report, check, lora_impl)  # the GPU fixture's object, without its GPU
"""
TEST = """
import torch

ATTEMPTS = []


def test_trains(tier):
    cfg = tier.config("quick")
    ATTEMPTS.append((cfg.data.batch_size, cfg.train.grad_accum))
    tier.check("a check before the step", 1, "==", 1)
    if cfg.data.batch_size > FITS:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    tier.check("effective batch", cfg.data.batch_size * cfg.train.grad_accum, "==", 8)


def test_attempts():
    assert ATTEMPTS == EXPECTED, ATTEMPTS
"""


def run(pytester, monkeypatch, fits: int, expected, *options):
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pytester.makeconftest((ROOT / "conftest.py").read_text() + TIER_FIXTURE)
    pytester.makepyfile(test_sample=TEST.replace("FITS", str(fits)).replace("EXPECTED", repr(expected)))
    args = ("--report-dir", "out", "-p", "no:cacheprovider", "-p", "no:randomly", "--lora-impl", "torch")
    result = pytester.runpytest_subprocess(*args, *options)
    return result, json.loads((pytester.path / "out" / "report.json").read_text())


def test_half_the_micro_batch_fits_and_the_pass_is_marked(pytester, monkeypatch):
    result, report = run(pytester, monkeypatch, 4, [(8, 1), (4, 2)], "--oom-retry")
    result.assert_outcomes(passed=2)
    names = [c["name"] for c in report["checks"]]
    assert names.count("a check before the step") == 1, names  # the failed attempt's records were taken back
    assert not any(n.startswith(OOM_CHECK) for n in names), names
    (retried,) = [c for c in report["checks"] if c["name"] == RETRIED_CHECK]
    assert retried["value"] == 4 and retried["threshold"] == 8 and retried["passed"], retried
    note = next(n for n in report["notes"] if "--oom-retry" in n)
    assert "micro-batch 8 -> 4, accumulation 1 -> 2: effective batch 8 -> 8" in note, note
    assert "ran out of memory at: outside the training loop" in note and "(micro-batch 8)" in note, note
    assert report["verdict"]["result"] == "PASS (RETRIED)", report["verdict"]
    assert "passed only with the micro-batch halved" in report["verdict"]["why"]


def test_without_the_option_the_out_of_memory_is_the_verdict(pytester, monkeypatch):
    result, report = run(pytester, monkeypatch, 4, [(8, 1)])
    result.assert_outcomes(passed=1, failed=1)
    assert report["verdict"]["result"] == "FAIL" and "(out of memory)" in report["verdict"]["why"]
    assert not any(c["name"] == RETRIED_CHECK for c in report["checks"])


def test_at_a_micro_batch_of_one_the_out_of_memory_stands(pytester, monkeypatch):
    result, report = run(pytester, monkeypatch, 0, [(8, 1), (4, 2), (2, 4), (1, 8)], "--oom-retry")
    result.assert_outcomes(passed=1, failed=1)
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    assert len(failed) == 1 and failed[0].startswith(OOM_CHECK), failed
    assert report["verdict"]["result"] == "FAIL", report["verdict"]


@pytest.mark.parametrize("error", ["ValueError('bad value')", "AssertionError('x')"])
def test_only_an_out_of_memory_is_retried(pytester, monkeypatch, error):
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pytester.makeconftest((ROOT / "conftest.py").read_text() + TIER_FIXTURE)
    pytester.makepyfile(
        test_sample=f"""
        CALLS = []

        def test_fails(tier):
            tier.config("quick")
            CALLS.append(1)
            raise {error}

        def test_once():
            assert CALLS == [1]
        """
    )
    result = pytester.runpytest_subprocess(
        "--report-dir", "out", "-p", "no:randomly", "--lora-impl", "torch", "--oom-retry"
    )
    result.assert_outcomes(passed=1, failed=1)


@pytest.mark.parametrize(
    "exc, stops",
    [
        (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
        (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"), True),
        (AssertionError("the report names a CUDA error"), False),
        (pytest.fail.Exception("a CUDA error test failed"), False),
        (ValueError("bad value"), False),
    ],
)
def test_only_a_cuda_error_stops_the_session(exc, stops):
    """A test whose id or assertion quotes "CUDA error" once stopped a whole session as if the context were lost."""
    from lora_suite.harness.cuda_errors import is_cuda_error

    assert is_cuda_error(exc) is stops


@pytest.mark.parametrize(("halvings", "batch", "k"), [(0, 8, 4), (1, 4, 4), (2, 2, 2), (3, 1, None)])
def test_a_retried_config_keeps_the_accumulation_check_within_its_micro_batch(halvings, batch, k):
    from lora_suite.harness.oom_retry import retried_config
    from lora_suite.settings.loader import CONFIG_DIR, load_tier_config

    cfg = retried_config(load_tier_config(CONFIG_DIR / "quick.yaml"), halvings)  # batch 8, grad_accum_k 4
    assert (cfg.data.batch_size, cfg.criteria.grad_accum_k) == (batch, k)
