"""``--oom-retry`` on the tier tests (those that take the ``tier`` fixture): each runs through
``lora_suite.harness.oom_retry.retrying``, which runs it again with half the micro-batch after an out-of-memory."""

from __future__ import annotations

import pytest

from lora_suite.harness.oom_retry import retrying
from lora_suite.harness.plugin.state import REPORT_KEY


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    if item.config.getoption("oom_retry", False) and "tier" in getattr(item, "fixturenames", ()):
        item.obj = retrying(item.obj, item.config.stash[REPORT_KEY])
