"""The first module a test process of a mutation run imports: the mutant replaces its module, and the line trace
the run asks for starts, before pytest loads any other plugin (``lora_suite.harness.pytest_plugin`` imports the
implementations).

``mutant_source.mutant_env`` and ``line_trace.trace_env`` put ``-p lora_suite.mutation.child`` in ``PYTEST_ADDOPTS``
(``line_trace.with_child_plugin``); pytest imports a ``-p`` plugin while it pre-parses its arguments, before the
``pytest11`` entry points and any ``conftest.py``. The harness never imports this package: mutation testing sits
above it."""

from __future__ import annotations

from lora_suite.mutation.mutant_source import install_from_env

install_from_env()
