"""The names ``--lora-impl`` knows without importing any implementation (the command line checks a name before it
starts pytest, and imports no torch): the built-ins, the peers bundled with the suite, and the entry-point group
through which other packages add theirs. ``lora_suite.implementations.lookup`` resolves them."""

from __future__ import annotations

import importlib.metadata
import re

ENTRY_POINT_GROUP = "lora_suite.implementations"
DEFAULT = "cupy"
# package.module:factory: a dotted module path of Python names (no dashes), a colon, a Python name
MODULE_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
BUILTINS = ("cupy", "cupy-fused", "torch", "peft")
# Peers bundled with the suite: the same specs as pyproject's entry points, so that a source checkout on PYTHONPATH
# (a GPU runner may run the suite uninstalled) finds them by name too.
BUNDLED = {
    "loralib": "lora_suite.implementations.loralib_impl:LoralibImplementation",
    "torchtune": "lora_suite.implementations.torchtune_impl:TorchtuneImplementation",
    "peft-bnb": "lora_suite.implementations.peft_bnb_impl:PeftBnbImplementation",
    "axolotl": "lora_suite.implementations.axolotl_impl:AxolotlImplementation",
    "peft-liger": "lora_suite.implementations.peft_liger_impl:PeftLigerImplementation",
    "unsloth": "lora_suite.implementations.unsloth_impl:UnslothImplementation",
}


def entry_point_names() -> list[str]:
    """Names of the entry points of ``ENTRY_POINT_GROUP`` and of the bundled peers."""
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)} | set(BUNDLED))


def known_names() -> list[str]:
    """Every name ``--lora-impl`` accepts without a ``module:factory``: built-ins first, then the rest sorted."""
    return list(BUILTINS) + [n for n in entry_point_names() if n not in BUILTINS]
