"""The suite's pytest plugin: options, the implementation under test, checks, GPU skips, CUDA-error stop,
seeding, cleanup and the run report. The repository's root ``conftest.py`` only loads it (the ``pytest11`` entry
point, for an installed suite; ``-p lora_suite.harness.pytest_plugin`` where the CLI runs from the package); this
module loads the plugin's modules, one concern each, in ``lora_suite/harness/plugin/``:

- ``options``: the command-line options (``pytest_addoption``);
- ``selection``: the markers, which tests run (a tier's marker on its tests, GPU skips, ``needs_feature``) and how
  pytest-xdist deals them out;
- ``run_report``: the run report's life, from configure (run id, environment, implementation) to the terminal
  summary, SIGTERM included;
- ``outcomes``: each test's outcome in the report, failed checks failing their test, a CUDA error stopping the session;
- ``fixtures``: ``run_report``, ``check``, ``lora_impl`` and the seeding and GPU clean-up around each test;
- ``log_frames``: captured log records keep a logged traceback as text, never its frames (nor what they hold).

Tests that need a GPU carry the ``gpu`` marker and skip with a reason when torch sees no CUDA device (a run that
judged nothing says so). A CUDA error (illegal address, device-side assert, a failed cuBLAS call) leaves the CUDA
context unusable: the session stops there instead of failing every later test.

Checks: a test records every criterion with the ``check`` fixture, ``check(name, value, op, threshold,
unit=, source=, detail=)``. Every check is recorded in the report, also after one has failed; a test with a
failed check fails when it ends, with each failed check and the line of the test that made it. A check the
implementation under test cannot take by design is recorded with ``check.not_applicable(name, reason)``;
a test that only makes sense with a feature carries ``@pytest.mark.needs_feature("<feature>")`` and is
recorded as not applicable (and skipped) when the implementation declares the feature unavailable.
"""

from __future__ import annotations

# The order of this tuple decides nothing: where one module's hook must run before another's, the hook says so.
# run_report's pytest_configure is ``tryfirst`` (the clock's "configured", the report and the implementation come
# before the others: selection's markers, outcomes' phase recorder), log_frames' is ``trylast`` (after pytest's
# logging plugin); outcomes' pytest_runtest_call is a wrapper around oom_retry's ``tryfirst`` one. Reversed, the
# tuple swaps only hooks that need nothing of each other (tests/suite/harness/test_plugin_hook_order.py). The
# session's state is its config's (``plugin/state.py``), never a module's.
pytest_plugins = (
    "lora_suite.harness.plugin.options",
    "lora_suite.harness.plugin.selection",
    "lora_suite.harness.plugin.run_report",
    "lora_suite.harness.plugin.outcomes",
    "lora_suite.harness.plugin.fixtures",
    "lora_suite.harness.plugin.log_frames",
    "lora_suite.harness.plugin.oom_retry",
)
