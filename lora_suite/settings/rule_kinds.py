"""What a settings rule is (``Rule``) and the makers the rule table (``settings_rules.RULES``) is written with:
``between`` (a range), ``one_of`` (a choice) and ``holds`` (any condition, worded). A rule judges one field of one
settings object by the value stored in it (``vars(obj)``: for ``AdapterSpec.adapter_dtype`` its name, never a torch
dtype), words the message after the key, and says which values break it (``Rule.breaking``: the tests' bad values).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lora_suite.settings.field_types import scalar_type

OUT_OF_RANGE = "{value} is out of range; expected {expected}"
NOT_ONE_OF = "{value} is not one of {expected}"
EXPECTED = "{value}; expected {expected}"
NOT_AMONG = "{value} not among {expected}"
NEEDS = "{value}; {expected}"

Changes = dict[str, object]


@dataclass(frozen=True)
class Rule:
    """One condition on one field of a settings object. ``expected`` is formatted with the object's fields
    (``"< steps={steps}"``) into the message ``form``; ``when`` (field, value): the rule applies only while that
    field holds that value; ``bad(obj)``: field changes that break this rule and none before it."""

    field: str
    ok: Callable[[object, object], bool]  # ok(value, obj)
    expected: str
    bad: Callable[[object], list[Changes]]
    form: str = OUT_OF_RANGE
    when: tuple[str, object] | None = None
    show: Callable[[object], object] | None = None  # what of the value the message shows (default: the value)

    def problem(self, obj) -> str | None:
        """The message after the key ("0 is out of range; expected >= 1") when ``obj`` breaks the rule, else None."""
        if self.when is not None and stored(obj, self.when[0]) != self.when[1]:
            return None
        value = stored(obj, self.field)
        if self.ok(value, obj):
            return None
        shown = self.show(value) if self.show else value
        return self.form.format(value=_shown(shown), expected=self.expected.format_map(_fields(obj)))

    def breaking(self, obj) -> list[Changes]:
        """Changes to ``obj`` that break this rule (``when``'s condition included): the tests' bad values."""
        condition = {self.when[0]: self.when[1]} if self.when else {}
        return [{**condition, **change} for change in self.bad(obj)]


def _shown(value) -> str:
    """A value as a message shows it: tuples as the lists YAML writes."""
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def stored(obj, field: str) -> Any:
    """The value ``obj`` holds in ``field``, as stored (a dtype field's name, not the torch dtype it reads as)."""
    return vars(obj)[field]


def _fields(obj) -> dict[str, object]:
    return {f.name: stored(obj, f.name) for f in dataclasses.fields(obj)}


def between(field, lo=None, hi=None, *, lo_open=False, hi_open=False, finite=False, null=False, **kw) -> Rule:
    """A number in [lo, hi] (``lo_open``/``hi_open``: that end excluded; either bound may be left out or name another
    field of the object); ``finite``: NaN and ±inf refused; ``null``: None allowed. ``text`` replaces the generated
    range words, ``note`` adds why in parentheses; ``form`` and ``when`` as in ``Rule``."""

    def ok(v, obj) -> bool:
        if v is None:
            return null
        low, high = _bound(lo, obj), _bound(hi, obj)
        return (
            (not finite or math.isfinite(v))
            and (low is None or (v > low if lo_open else v >= low))
            and (high is None or (v < high if hi_open else v <= high))
        )

    def bad(obj) -> list[Changes]:
        kind = scalar_type(type(obj), field)
        step = kind(1)
        values = [] if lo is None else [kind(_bound(lo, obj) - (0 if lo_open else step))]
        values += [] if hi is None else [kind(_bound(hi, obj) + (0 if hi_open else step))]
        values += [math.nan, math.inf] if finite else []
        return [{field: v} for v in values]

    text = kw.pop("text", None) or ("null or " if null else "") + _range_words(lo, hi, lo_open, hi_open, finite)
    return _rule(field, ok, text, bad, **kw)


def _bound(b, obj):
    return stored(obj, b) if isinstance(b, str) else b


def _range_words(lo, hi, lo_open, hi_open, finite) -> str:
    """The generated words of a range: ">= 1", "finite, > 0", "0 < x < 1"; a bound that names a field shows its value
    (">= aged_vs_fresh_pairs={aged_vs_fresh_pairs}")."""

    def word(b) -> str:
        return f"{b}={{{b}}}" if isinstance(b, str) else str(b)

    if lo is not None and hi is not None:
        return f"{word(lo)} {'<' if lo_open else '<='} x {'<' if hi_open else '<='} {word(hi)}"
    if lo is not None:
        return ("finite, " if finite else "") + f"{'>' if lo_open else '>='} {word(lo)}"
    return ("finite, " if finite else "") + f"{'<' if hi_open else '<='} {word(hi)}"


def one_of(field, allowed: tuple, *, text: str | None = None, form: str = NOT_ONE_OF) -> Rule:
    """One of ``allowed`` (named as a list unless ``text`` words it)."""
    return Rule(
        field, lambda v, obj: v in allowed, text or repr(list(allowed)), lambda obj: [{field: f"no-{field}"}], form
    )


def _rule(field, ok, expected, bad, *, note: str = "", form: str = OUT_OF_RANGE, when=None, show=None) -> Rule:
    return Rule(field, ok, expected + (f" ({note})" if note else ""), bad, form, when, show)


def holds(field, ok, expected: str, bad, **kw) -> Rule:
    """A condition ``ok(value, obj)`` worded by ``expected``; ``bad(obj)`` lists changes that break it; ``note``,
    ``form`` (here ``EXPECTED`` unless given), ``when`` and ``show`` as in ``Rule``."""
    return _rule(field, ok, expected, bad, **{"form": EXPECTED, **kw})
