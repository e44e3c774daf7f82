"""The adapters' dtype of the LoRA settings (``AdapterSpec.adapter_dtype``): held by its name, read as a torch dtype.

The YAML names it (``adapter_dtype: float32``) and is read by processes that never import torch (the command line,
the controlling process of a run spread over workers); an implementation is handed a torch dtype. ``AdapterDtype``
is the dataclass field (a descriptor: Python's dataclasses call its ``__set__`` on construction) that serves both:

- set: a torch floating-point dtype or its name (``torch.float32`` or ``"float32"``), or None (the base weight's
  dtype). A floating-point torch dtype is stored as its name; anything else is stored as given, and the field's rule
  (``settings_rules.RULES["AdapterSpec"]``) refuses it by that value;
- get: the torch dtype (torch is imported then, by the reader who wants a dtype), or None;
- the stored name, without torch: ``vars(obj)["adapter_dtype"]`` (``AdapterSpec.dtype_name``), which the rules, the
  loader and the memory estimate read.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:
    import torch

ADAPTER_DTYPES = ("float32", "bfloat16", "float16", "float64")  # the floating-point dtypes an adapter is made in


class AdapterDtype:
    """A frozen dataclass's dtype field, stored by name (see the module docstring); ``default``: a name or None."""

    def __init__(self, default: str | None) -> None:
        self.default = default
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> str | None: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> torch.dtype | None: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> torch.dtype | str | None:
        if obj is None:  # the class's attribute: the dataclass reads the field's default here
            return self.default
        name = vars(obj)[self.name]
        if name is None or not isinstance(name, str):
            return name
        import torch

        return getattr(torch, name)

    def __set__(self, obj: object, value: torch.dtype | str | None) -> None:
        vars(obj)[self.name] = dtype_name(value)


def dtype_name(value: object) -> object:
    """A floating-point torch dtype's name (``torch.bfloat16`` -> ``"bfloat16"``); any other value as it is."""
    torch = sys.modules.get("torch")  # a torch dtype exists only where torch was imported
    if torch is not None and isinstance(value, torch.dtype) and value.is_floating_point:
        return str(value).removeprefix("torch.")
    return value
