"""Log records keep no objects: a logged exception's traceback and the message's arguments are turned into text where
pytest keeps the record.

pytest's log capture keeps every record of a test (``caplog`` and the report's "Captured log" section) until the
test ends, and a record logged with ``exc_info`` holds the traceback, whose frames hold every local variable of every
function it passed through. On an H200 the full tier under ``--fused-ops liger`` logged an ImportError caught inside
a library while the tier's 16-bit comparison model (12,884 MiB) was a local of a frame on that traceback: the model
stayed allocated through the QLoRA run, which a 16 GB card could not hold (issue 56, item 5).

The record the H200 run kept held the exception not as ``exc_info`` but as one of the message's arguments
(``record.args``, a tuple of 4): any object passed to a log call (an exception, a tensor, a model) lives as long as
the record. ``DropFrames`` on pytest's capture handlers formats the message into ``record.msg`` with ``args``
emptied (what ``logging.handlers.QueueHandler.prepare`` does before a record leaves its process) and the traceback
into ``record.exc_text`` with ``exc_info`` dropped: every formatter prints the same text, and the frames and objects
are freed when the code that logged leaves them."""

from __future__ import annotations

import logging

import pytest


class DropFrames(logging.Filter):
    """A handler filter: the record's message and traceback kept as text only (``msg``, ``exc_text``), its ``args``
    and ``exc_info`` dropped."""

    _format = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            try:
                record.msg = record.getMessage()
            except Exception as exc:  # noqa: BLE001  (a message whose arguments do not fit it: say so, keep nothing)
                record.msg = f"{record.msg!r} (its arguments did not format: {type(exc).__name__}: {exc})"
            record.args = None
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
