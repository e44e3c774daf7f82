"""What every planted copy of the shipped example (``examples/plain_lora.py``) is built from: the example loaded from
the checkout, its LoRA term, and the factories that replace its layer's forward, ``__init__`` or its own methods. The
plants themselves are ``example_plants`` and its three companions (``_arch``, ``_state``, ``_values``), which import
this module and not one another."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch.nn.functional as F

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plain_lora.py"


def _example():
    """The example module, loaded once as ``plain_lora`` (the name users import it by)."""
    if "plain_lora" not in sys.modules:
        spec = importlib.util.spec_from_file_location("plain_lora", EXAMPLE)
        if spec is None or spec.loader is None or not EXAMPLE.is_file():
            raise ImportError(f"{EXAMPLE}: the example implementation is not there (a checkout is needed)")
        module = importlib.util.module_from_spec(spec)
        sys.modules["plain_lora"] = module
        spec.loader.exec_module(module)
    return sys.modules["plain_lora"]


def _lora(layer, x, a, b):
    return F.linear(F.linear(x, a), b)


def _planted(name: str, *, forward=None, **methods):
    """The example implementation with its layer's forward and/or its own methods replaced."""
    ex = _example()
    layer_type = ex.PlainLoRALinear
    if forward is not None:
        layer_type = type(f"PlainLoRALinear_{name}", (ex.PlainLoRALinear,), {"forward": forward})
    impl_type = type(f"PlainLoRA_{name}", (ex.PlainLoRA,), {"layer_type": layer_type, **methods})
    impl = impl_type()
    impl.name = impl.expected_path = "plain-lora"
    return impl


def _forward_plant(name: str, forward):
    """The factory of the example whose layer's forward is ``forward`` (``--lora-impl ...example_plants:<name>``)."""

    def factory():
        return _planted(name, forward=forward)

    factory.__name__ = factory.__qualname__ = name
    return factory


def _layer_init_then(name: str, init):
    """The example whose layer's ``__init__`` is ``init(layer, example_init, base, r, alpha, use_rslora,
    adapter_dtype)``, ``example_init`` the example's own (bound)."""
    example_layer: Any = _example().PlainLoRALinear  # a class of a module loaded from a file: its type is run-time's

    class Layer(example_layer):
        def __init__(self, base, r, alpha, use_rslora, adapter_dtype):
            init(self, super().__init__, base, r, alpha, use_rslora, adapter_dtype)

    return _planted(name, layer_type=Layer)
