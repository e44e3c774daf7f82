"""The names ``--lora-impl`` knows without importing any implementation (the command line checks a name before it
starts pytest, and imports no torch): the built-ins, the peers bundled with the suite, and the entry-point group
through which other packages add theirs. ``lora_suite.implementations.lookup`` resolves them."""

from __future__ import annotations

import importlib.metadata
import re
from typing import NamedTuple

ENTRY_POINT_GROUP = "lora_suite.implementations"
DEFAULT = "cupy"
BUILTINS = ("cupy", "cupy-fused", "torch", "peft")
# The implementation spec, parsed here only (``parse_spec``): a registered name (dashes allowed, as in "cupy-fused"),
# or package.module:factory, a dotted module path of Python names (no dashes), a colon, a Python name
NAME_SPEC = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
MODULE_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
EXPECTED = (
    f"a name (a built-in: {', '.join(BUILTINS)}; a bundled peer; an entry point of {ENTRY_POINT_GROUP!r}) or "
    "'package.module:factory' (a dotted module path of Python names, no dashes, a colon, a Python name)"
)
# Peers bundled with the suite: the same specs as pyproject's entry points, so that a source checkout on PYTHONPATH
# (a GPU runner may run the suite uninstalled) finds them by name too.
BUNDLED = {
    "loralib": "lora_suite.implementations.loralib_impl:LoralibImplementation",
    "torchtune": "lora_suite.implementations.torchtune_impl:TorchtuneImplementation",
    "peft-bnb": "lora_suite.implementations.peft_bnb_impl:PeftBnbImplementation",
    "axolotl": "lora_suite.implementations.axolotl_impl:AxolotlImplementation",
    "peft-liger": "lora_suite.implementations.peft_liger_impl:PeftLigerImplementation",
    "unsloth": "lora_suite.implementations.unsloth_impl:UnslothImplementation",
    "transformers-adapter": "lora_suite.implementations.transformers_adapter_impl:TransformersAdapterImplementation",
}


def entry_point_names() -> list[str]:
    """Names of the entry points of ``ENTRY_POINT_GROUP`` and of the bundled peers."""
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)} | set(BUNDLED))


def known_names() -> list[str]:
    """Every name ``--lora-impl`` accepts without a ``module:factory``: built-ins first, then the rest sorted."""
    return list(BUILTINS) + [n for n in entry_point_names() if n not in BUILTINS]


class SpecError(ValueError):
    """An implementation spec that is neither a name nor ``package.module:factory``; the message names it."""


class ImplementationSpec(NamedTuple):
    """A parsed spec: ``module`` and ``factory`` are set for ``package.module:factory``, None for a name."""

    text: str
    module: str | None = None
    factory: str | None = None

    @property
    def is_module(self) -> bool:
        return self.module is not None


def parse_spec(text: object) -> ImplementationSpec:
    """The one parser of the implementation spec (``--lora-impl``, a tier YAML's ``implementation``, the lookup):
    a name (``NAME_SPEC``, not yet checked against the known names) or ``package.module:factory``
    (``MODULE_SPEC``); anything else raises a SpecError naming the value and ``EXPECTED``."""
    if not isinstance(text, str) or not text.strip():
        raise SpecError(f"LoRA implementation {text!r}: expected {EXPECTED}")
    if ":" in text:
        if not MODULE_SPEC.fullmatch(text):
            raise SpecError(
                f"LoRA implementation {text!r}: expected package.module:factory (a dotted module path of Python "
                "names, no dashes, a colon, a Python name)"
            )
        module, _, factory = text.partition(":")
        return ImplementationSpec(text, module, factory)
    if not NAME_SPEC.fullmatch(text):
        raise SpecError(f"LoRA implementation {text!r}: expected {EXPECTED}")
    return ImplementationSpec(text)
