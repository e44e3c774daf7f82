"""The fixtures every test of the suite may take: ``run_report``, ``check`` (a criterion recorded in it),
``lora_impl`` (the implementation under test), and the autouse seeding and GPU clean-up around each test."""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator

import pytest

from lora_suite.harness.checks import Checker
from lora_suite.harness.plugin.state import FAILED_KEY, IMPL_KEY, REPORT_KEY
from lora_suite.harness.report import RunReport
from lora_suite.implementations import LoRAImplementation


@pytest.fixture(autouse=True)
def _seed_and_cleanup() -> Iterator[None]:
    """Every test starts from the same seeds and leaves no cached GPU memory behind for the next.

    A full ``gc.collect()`` walks every tracked object (300k after importing torch and transformers, 470k
    once torch.compile has run: 0.15-0.25 s each time), which after every test was 15 s of the quick tier's
    37 s (reports/20261122T080902Z-quick, junit times minus call times). So the collection runs only when it
    can matter: when the test leaves more GPU memory allocated than it found (memory that only a cycle may
    still hold). Tests that measure memory collect before they measure (tiers/conftest.py).
    """
    import torch

    random.seed(0)
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    allocated_before = torch.cuda.memory_allocated() if cuda else 0
    yield
    if cuda:
        torch.cuda.synchronize()
        if torch.cuda.memory_allocated() > allocated_before:
            gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


@pytest.fixture(scope="session")
def run_report(request: pytest.FixtureRequest) -> RunReport:
    """The session's run report (opened when pytest was configured)."""
    return request.config.stash[REPORT_KEY]


@pytest.fixture
def check(run_report: RunReport, request: pytest.FixtureRequest) -> Checker:
    """``check(name, value, op, threshold, unit=, source=, detail=)``: a criterion recorded in the run report."""
    failed = request.node.stash.setdefault(FAILED_KEY, [])
    return Checker(run_report, request.node.nodeid, failed)


@pytest.fixture(scope="session")
def lora_impl(request: pytest.FixtureRequest) -> LoRAImplementation:
    """The LoRA implementation under test (--lora-impl, default cupy)."""
    return request.config.stash[IMPL_KEY]
