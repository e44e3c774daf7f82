"""The environment variables the suite reads, each with what it must hold: one registry (``ENV_VARS``), checked where
a command or a pytest session starts (``environment_problem``), so a bad value is one line naming the variable, its
value and what was expected, before any work, never an INTERNALERROR or a traceback mid-run.

An empty value is the variable unset. ``number`` and ``integer`` read a checked value where it is used. Variables set
by others and only passed on or read as text (``PYTEST_CURRENT_TEST``, torchrun's ``RANK``, ``PGPASSWORD``) are not
the suite's settings and are listed in ``FOREIGN`` (``tests/suite/repository/test_env_vars.py`` finds every name the
code reads in one of the two).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    expected: str  # what a value must be, in words (the message's "expected ...")
    ok: Callable[[str], bool]
    does: str  # what it sets


def _number(lo: float, integer: bool = False) -> Callable[[str], bool]:
    def ok(text: str) -> bool:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            return False
        return math.isfinite(value) and value >= lo

    return ok


def _one_of(*values: str) -> Callable[[str], bool]:
    return lambda text: text in values


def _folder(text: str) -> bool:
    return os.path.isdir(text)


_FLAG = ("0 or 1", _one_of("0", "1"))
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_HYPOTHESIS = ("ci", "nightly")  # lora_suite.judges.hypothesis_profiles.PROFILES

ENV_VARS = {
    v.name: v
    for v in (
        EnvVar(
            "LORA_SUITE_PROGRESS_INTERVAL_S", "a number of seconds >= 0", _number(0), "seconds between progress lines"
        ),
        EnvVar("LORA_SUITE_FUSED_ROUNDS", "an integer >= 1", _number(1, True), "timed rounds of the fused table"),
        EnvVar("LORA_SUITE_HYPOTHESIS_PROFILE", f"one of {list(_HYPOTHESIS)}", _one_of(*_HYPOTHESIS), "drawn cases"),
        EnvVar(
            "LORA_SUITE_RUN_ID",
            "letters, digits, '.', '_' or '-' (a folder name), at most 200",
            lambda t: bool(_RUN_ID.fullmatch(t)),
            "the run's id and folder name",
        ),
        EnvVar("LORA_SUITE_CONFIG_DIR", "an existing folder", _folder, "the tier YAML files"),
        EnvVar("LORA_SUITE_TIERS_DIR", "an existing folder", _folder, "the tier test folders"),
        EnvVar("LORA_SUITE_REQUIRE_GPU", *_FLAG, "a run that saw no GPU fails"),
        EnvVar("LORA_SUITE_REQUIRE_POSTGRES", *_FLAG, "the store's tests fail without PostgreSQL"),
        EnvVar("LORA_SUITE_REQUIRE_BROWSER", *_FLAG, "the history page's test fails without Chromium"),
        EnvVar("LORA_SUITE_REQUIRE_TYPES", *_FLAG, "the type check fails without mypy"),
        EnvVar("LORA_SUITE_PYTEST_AUTOLOAD", *_FLAG, "pytest's plugin autoload in the suite's runs"),
        EnvVar("LORA_SUITE_BYTECODE_SETUP_S", "a number of seconds >= 0", _number(0), "the set-up's seconds"),
        EnvVar("GPU_TEST_GPU_COUNT", "an integer >= 0", _number(0, True), "GPUs assumed by `all` (tests)"),
        EnvVar("GPU_TEST_T0", "a Unix time in seconds >= 0", _number(0), "when the command started"),
        EnvVar("GPU_TEST_DRY_RUN", *_FLAG, "print the command instead of running it (tests)"),
        EnvVar("SCORECARD_DRY_RUN", *_FLAG, "print the scorecard's commands instead of running them"),
        EnvVar("LORA_CORE_BACKEND", "'cupy' or 'torch'", _one_of("cupy", "torch"), "lora_core's default backend"),
    )
}
# Read by the suite but set by others, or passed on as they are (not settings of the suite)
FOREIGN = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        "PYTEST_ADDOPTS",
        "PYTHONPATH",
        "PGPASSWORD",
        "PYTHON",
        "LORA_SUITE_STORE",  # a location: lora_suite.results.store names a bad one when it opens it
        "LORA_SUITE_GIT_COMMIT",  # free text: the commit a copy without .git was made from
        "LORA_SUITE_MUTANT_MODULE",
        "LORA_SUITE_MUTANT_FILE",
        "LORA_SUITE_TRACE_FILES",
        "LORA_SUITE_TRACE_OUT",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)


def environment_problem(environ: Mapping[str, str] | None = None) -> str | None:
    """The first of the suite's variables set to a value it cannot take, as one line, or None."""
    environ = os.environ if environ is None else environ
    for v in ENV_VARS.values():
        text = environ.get(v.name, "")
        if text != "" and not v.ok(text):
            return f"${v.name}={text!r} ({v.does}): expected {v.expected}; unset it or give a value of that form"
    return None


def number(name: str, default: float) -> float:
    """``$name`` as a number (checked: ``environment_problem``), ``default`` where unset."""
    text = os.environ.get(name, "")
    if text == "":
        return default
    if not ENV_VARS[name].ok(text):
        raise ValueError(f"${name}={text!r}: expected {ENV_VARS[name].expected}")
    return float(text)
