"""Which tests run, and where: the suite's markers (registered, put on a tier's tests, acted on), the skip of GPU
tests where torch sees no CUDA device, the not-applicable skip of ``needs_feature``, and how a run spread over
pytest-xdist workers deals its tests out."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from lora_suite.harness import worker_groups
from lora_suite.harness.plugin.state import IMPL_KEY, REPORT_KEY, tiers
from lora_suite.implementations import FEATURES

if TYPE_CHECKING:
    from xdist.remote import Producer
    from xdist.scheduler.protocol import Scheduling


def pytest_configure(config: pytest.Config) -> None:
    """Register the suite's markers: ``needs_feature``, the worker group and each registered tier's (after
    run_report's ``tryfirst`` pytest_configure has opened the run report)."""
    config.addinivalue_line(
        "markers",
        "needs_feature(name): needs a feature of the LoRA implementation under test "
        "(lora_suite.implementations.FEATURES); not applicable where it declares it unavailable",
    )
    config.addinivalue_line("markers", worker_groups.DESCRIPTION)
    for tier in tiers().values():  # the tier registry's markers: a new tier needs no edit of any Python or ini
        config.addinivalue_line("markers", f"{tier.marker}: {tier.entry.description}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> Scheduling | None:
    """``--dist loadgroup`` (lora-suite's workers): the tests that import the model code share a few workers."""
    return worker_groups.make_scheduler(config, log) if config.getoption("dist") == "loadgroup" else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test in a registered tier's folder carries the tier's marker (and ``gpu``); GPU tests skip without one."""
    folders = {t.tests_dir.resolve(): t.marker for t in tiers().values()}
    for item in items:
        marker = folders.get(Path(item.path).resolve().parent)
        if marker and item.get_closest_marker(marker) is None:
            item.add_marker(getattr(pytest.mark, marker))
            item.add_marker(pytest.mark.gpu)
    import torch  # a process that collects runs tests: torch is its own import

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: none found (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``needs_feature(f)`` is not applicable to an implementation that declares f unavailable."""
    impl = item.config.stash[IMPL_KEY]
    for mark in item.iter_markers("needs_feature"):
        feature = mark.args[0]
        if feature not in FEATURES:
            raise pytest.UsageError(f"{item.nodeid}: needs_feature({feature!r}) is not one of {sorted(FEATURES)}")
        reason = impl.reason_not_applicable(feature)
        if reason:
            module = item.nodeid.split("::", 1)[0]
            item.config.stash[REPORT_KEY].mark_module_not_applicable(module, FEATURES[feature], reason)
            pytest.skip(f"not applicable to --lora-impl {impl.name}: {reason}")
