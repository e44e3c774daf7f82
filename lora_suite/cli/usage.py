"""Usage errors that name the bad value: an option's value must not be another flag (``--report-dir --check-vram``
is a mistake, not a folder), and retired flags say what replaced them."""

from __future__ import annotations

VALUE_OF = {  # option -> what it needs
    "--report-dir": "a directory",
    "--lora-impl": "a value (cupy, torch, peft or package.module:factory)",
    "--weights": "a value (auto, pretrained or random)",
    "--baseline": "a directory",
    "--gpus": "a number of GPUs (2 or more)",
    "--nodes": "a number of nodes",
    "--node-rank": "a node index (0 for the node that judges)",
    "--rdzv-endpoint": "HOST:PORT (node 0's address)",
    "--shared-dir": "a directory every node sees",
    "--ledger": "a ledger file",
    "--jobs": "a whole number >= 1",
    "--workers": "a whole number >= 1 or auto",
    "--html": "a path ending in .html",
    "--group": "a group name",
    "--source": "a Python source file",
    "--min-score": "a number from 0 to 1",
    "--operators": "mutation operator names, comma-separated",
}


class UsageError(Exception):
    """Bad usage: the message names the value and what was expected (exit 2)."""


def check_values(argv: list[str]) -> None:
    for i, arg in enumerate(argv):
        if arg == "--backend" or arg.startswith("--backend="):
            raise UsageError("--backend was replaced by --lora-impl (cupy, torch, peft or package.module:factory)")
        flag, eq, value = arg.partition("=")
        if flag not in VALUE_OF:
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if not value or value.startswith("-"):
            raise UsageError(f"{flag} needs {VALUE_OF[flag]}, got {value!r}")
