"""Every number of every settings object has its range rule, named by its field (``settings_rules.RULES``): a new
int or float field of a settings dataclass (``lora_suite/settings/config.py``, ``AdapterSpec`` among them, or any
other ``Checked`` class) fails here until its rule is written, so that no value goes unchecked."""

from __future__ import annotations

import dataclasses
import inspect

import lora_suite.implementations.contract  # noqa: F401  (every Checked class of the suite defined)
from lora_suite.settings import config
from lora_suite.settings.config import Checked
from lora_suite.settings.field_types import field_types, scalar_type
from lora_suite.settings.rule_kinds import Rule, between
from lora_suite.settings.settings_rules import rules_of


def ruleless_numbers(cls: type, rules: tuple[Rule, ...]) -> list[str]:
    """The int and float fields (``| None`` included) of dataclass ``cls`` that no rule of ``rules`` names."""
    named = {rule.field for rule in rules}
    return [name for name in field_types(cls) if scalar_type(cls, name) in (int, float) and name not in named]


def _checked_classes() -> set[type]:
    out, todo = set(), [Checked]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        out |= {c for c in cls.__subclasses__() if c.__module__.startswith("lora_suite.")}
    return out


SETTINGS = {c for c in vars(config).values() if inspect.isclass(c) and dataclasses.is_dataclass(c)} | _checked_classes()


def test_every_settings_class_is_walked():
    names = {c.__name__ for c in SETTINGS}
    assert {"AdapterSpec", "Criteria", "TrainSettings", "DataSettings", "LlamaArchitecture", "TierConfig"} <= names


def test_every_numeric_field_has_a_rule():
    missing = {c.__name__: bad for c in SETTINGS if (bad := ruleless_numbers(c, rules_of(c)))}
    assert missing == {}, "write each field's rule in lora_suite/settings/settings_rules.py RULES"


@dataclasses.dataclass(frozen=True)
class _MadeUp:
    steps: int = 1
    ratio: float | None = None  # a float without a rule
    name: str = "x"
    flags: tuple[int, ...] = ()  # not a number: a tuple


def test_a_ruleless_float_is_caught():
    assert ruleless_numbers(_MadeUp, (between("steps", lo=1),)) == ["ratio"]
    assert ruleless_numbers(_MadeUp, ()) == ["steps", "ratio"]
    assert ruleless_numbers(_MadeUp, (between("steps", lo=1), between("ratio", lo=0, null=True))) == []
