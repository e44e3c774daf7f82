"""The types of a settings object's fields, checked on construction before its rules (``type_problem``): an int
field takes no bool and no float, a float field takes an int, a tuple field a tuple of its items' type.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import typing


def scalar_type(cls: type, field: str) -> type:
    """The int, float, str or bool a field holds (its annotation without ``| None``)."""
    hint = field_types(cls)[field]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint


@functools.cache
def field_types(cls: type) -> dict[str, typing.Any]:
    """Each field's annotation, resolved. A field that converts what it is given (a descriptor:
    ``AdapterDtype``) is left out, and so is one whose annotation cannot be resolved at run time: their rules judge
    the values they store."""
    names = vars(sys.modules[cls.__module__])
    out = {}
    for f in dataclasses.fields(cls):
        try:
            hint = eval(f.type, names) if isinstance(f.type, str) else f.type  # the class's own annotation
        except (NameError, AttributeError):
            continue
        if not hasattr(hint, "__set__"):
            out[f.name] = hint
    return out


def type_problem(obj) -> tuple[str, str] | None:
    """(field, "expected int, got '8'") for the first field whose value is not of its annotated type, else None.
    bool is not an int here, and a float field takes an int."""
    cls: type = type(obj)  # annotated: mypy does not take a type[...] for functools.cache's Hashable argument
    for name, hint in field_types(cls).items():
        value = vars(obj)[name]  # as stored
        if not _is(hint, value):
            return name, f"expected {_type_words(hint)}, got {value!r}"
    return None


def _is(hint, value) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is(a, value) for a in args)
    if origin is tuple:
        return isinstance(value, tuple) and all(_is(args[0], v) for v in value)
    if hint in (int, float):
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # an annotation this check does not know: its rules judge the value


def _type_words(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_words(a) for a in args)
    if origin is tuple:
        return f"a tuple of {_type_words(args[0])}"
    return {float: "a number", type(None): "None"}.get(hint, getattr(hint, "__name__", str(hint)))
