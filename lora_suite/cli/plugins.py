"""Which pytest plugins a run of the command line loads: the GPU targets only those they name, the CPU self-tests
(and any run under ``$LORA_SUITE_PYTEST_AUTOLOAD=1``) every installed one."""

from __future__ import annotations

import os

# GPU targets run pytest without the third-party plugins the environment happens to have (hypothesis, anyio,
# jaxtyping, xdist, cov, mock...: 2-3 s of imports on a fresh GPU machine, none used by the tiers); pytest-benchmark
# is loaded by name. LORA_SUITE_PYTEST_AUTOLOAD=1 loads every installed plugin again (the CPU self-tests always do).
AUTOLOAD_ENV = "LORA_SUITE_PYTEST_AUTOLOAD"


def autoload_plugins(target: str) -> bool:
    """Whether ``target``'s pytest loads every installed plugin (else only those named with ``-p``)."""
    return target == "selftest" or os.environ.get(AUTOLOAD_ENV) == "1"
