"""Log records keep no frames: a logged exception's traceback is turned into text where pytest keeps the record.

pytest's log capture keeps every record of a test (``caplog`` and the report's "Captured log" section) until the
test ends, and a record logged with ``exc_info`` holds the traceback, whose frames hold every local variable of every
function it passed through. On an H200 the full tier under ``--fused-ops liger`` logged an ImportError caught inside
a library while the tier's 16-bit comparison model (12,884 MiB) was a local of a frame on that traceback: the model
stayed allocated through the QLoRA run, which a 16 GB card could not hold (issue 56, item 5).

``DropFrames`` on pytest's capture handlers formats the traceback into ``record.exc_text`` (what every formatter
prints: the log text is unchanged) and drops ``exc_info``, so the frames are freed when the code that logged leaves
them."""

from __future__ import annotations

import logging

import pytest


class DropFrames(logging.Filter):
    """A handler filter: the record's traceback kept as text only (``exc_text``), its ``exc_info`` dropped."""

    _format = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            if not record.exc_text:
                record.exc_text = self._format.formatException(record.exc_info)
            record.exc_info = None
        return True


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """The filter on the handlers of pytest's logging plugin that keep records (``caplog``'s and the report's)."""
    logging_plugin = config.pluginmanager.get_plugin("logging-plugin")
    for name in ("caplog_handler", "report_handler"):
        handler = getattr(logging_plugin, name, None)
        if handler is not None:
            handler.addFilter(DropFrames())
