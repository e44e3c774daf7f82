"""Progress lines on the terminal while a long test runs."""

from __future__ import annotations

import logging
import time

from lora_suite.settings import env_vars


class ProgressLines(logging.Handler):
    """Training progress lines on the terminal while a test runs, past pytest's output capture.

    Long tiers (the full tier runs for minutes) would otherwise print nothing between start and result.
    """

    def __init__(self, config):
        super().__init__(logging.INFO)
        self.config = config
        # at most one line per 10 s: long tiers show progress, short tests stay quiet
        self.min_interval_s = env_vars.number("LORA_SUITE_PROGRESS_INTERVAL_S", 10.0)
        self.last = time.monotonic()

    def emit(self, record):
        if time.monotonic() - self.last < self.min_interval_s:
            return
        self.last = time.monotonic()
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        capman = self.config.pluginmanager.get_plugin("capturemanager")
        if tr is None or capman is None:
            return
        with capman.global_and_fixture_disabled():
            tr.ensure_newline()
            tr.write_line(f"  [{record.name.rsplit('.', 1)[-1]}] {record.getMessage()}")
