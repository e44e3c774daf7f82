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


def check_text_values(args) -> None:
    """Every text a command line gave (an option's value, a positional path or name) holds something printable: a
    blank one, or one with a control character (a newline pasted into a path), is refused naming it, whatever the
    option, before it becomes a folder or a label."""
    for dest, value in vars(args).items():
        for text in value if isinstance(value, list) else [value]:
            if not isinstance(text, str):
                continue
            what = f"--{dest.replace('_', '-')}" if dest not in ("dirs", "runs", "file", "out", "target") else dest
            if not text.strip():
                raise UsageError(f"{what} {text!r}: blank; expected a value of printable characters")
            if any(ord(c) < 32 or ord(c) == 127 for c in text):
                raise UsageError(f"{what} {text!r}: holds a control character; expected printable characters only")
