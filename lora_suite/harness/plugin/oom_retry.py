"""``--oom-retry`` on the tier tests (those that take the ``tier`` fixture): each runs through
``lora_suite.harness.oom_retry.retrying``, which runs it again with half the micro-batch after an out-of-memory."""

from __future__ import annotations

import pytest

from lora_suite.harness.oom_retry import retrying
from lora_suite.harness.plugin.state import REPORT_KEY


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """First of the plain ``pytest_runtest_call`` hooks (``tryfirst``): the test function is wrapped before pytest's
    own hook calls it; ``outcomes``' wrapper runs around both, whatever order the modules were registered in."""
    if not (item.config.getoption("oom_retry", False) and isinstance(item, pytest.Function)):
        return
    if "tier" in item.fixturenames:
        item.obj = retrying(item.obj, item.config.stash[REPORT_KEY])
