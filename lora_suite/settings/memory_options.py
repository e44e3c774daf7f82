"""The run options of the card's memory, written once: ``lora-suite`` (argparse, ``lora_suite.cli``) and the pytest
plugin (``lora_suite.harness.plugin.options``) declare each from this table, so the two never drift apart."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryOption:
    """One option: a flag (``store_true``) or, with ``metavar``, an option that takes a value."""

    name: str
    help: str
    metavar: str | None = None

    def kwargs(self) -> dict[str, str]:
        """The keyword arguments argparse's ``add_argument`` and pytest's ``addoption`` both take."""
        shape = {"metavar": self.metavar} if self.metavar else {"action": "store_true"}
        return {**shape, "help": self.help}


MEMORY_OPTIONS = (
    MemoryOption(
        "--check-vram",
        "before each tier, compare the LoRA-aware memory estimate with NVML free memory; skip the tier when short",
    ),
    MemoryOption("--strict-vram", "with --check-vram: fail instead of skipping when the estimate exceeds free memory"),
    MemoryOption(
        "--vram-limit",
        "judge as if on a card of GIB GiB (16, 24): each test process's allocator capped to it, --check-vram "
        "against it",
        metavar="GIB",
    ),
    MemoryOption(
        "--oom-retry",
        "run a test that ran out of GPU memory again with half the micro-batch and twice the accumulation (the "
        "effective batch kept), down to a micro-batch of 1; its pass reads PASS (RETRIED)",
    ),
)
