"""A planted resume defect, for the convergence tier's resumed-run check: after ``load_adapter`` the adapters are
listed with their decoder layers in text order (layers 0, 1, 10, 11, ..., 19, 2, 20, ...), as a list rebuilt from a
checkpoint's sorted keys lists them.

``--lora-impl lora_suite.scenarios.resume_layers_in_text_order:cupy_text_order`` is lora_core's cupy
implementation, reported as cupy. Training, saving and loading are cupy's, bit for bit; only the list that
``adapter_parameters`` returns for a model that has loaded adapters is reordered. torch keys an optimizer's state by
each parameter's position in its list, so the resumed optimizer gives layer 10's AdamW moments to layer 2's
adapters, and so on. Every decoder layer has the same projections, so every moment finds a tensor of its shape: the
load succeeds and nothing raises, and the resumed run trains with wrong moments (the class of a resume whose
parameters are enumerated differently from the run that saved them). A model of 10 decoder layers or fewer is not
reordered (single digits sort alike as text and as numbers); SmolLM2-135M has 30. Its test: selftest-gpu's
``test_planted_resume_layers_in_text_order.py``.
"""

from __future__ import annotations

import re

from lora_suite.implementations.lora_core_impl import LoraCoreImplementation

LAYER = re.compile(r"\.layers\.(\d+)\.")
LOADED = "_lora_suite_planted_loaded"  # set on a model that has loaded adapters


def text_order(names: list[str]) -> list[str]:
    """``names`` with their decoder layers in text order of the layer index, each layer's names in their own order
    (a name outside the decoder layers first)."""

    def key(name: str) -> str:
        m = LAYER.search(name)
        return "" if m is None else m.group(1)

    return sorted(names, key=key)  # sorted is stable: a layer's own names keep their order


class TextOrderAfterLoad(LoraCoreImplementation):
    """lora_core's ``backend`` implementation whose adapter list, once a model has loaded adapters, is in text
    order of the layer index."""

    def describe(self) -> str:
        return super().describe() + " [planted: adapters listed in text order of the layer index after a load]"

    def load_adapter(self, model, path) -> None:
        super().load_adapter(model, path)
        setattr(model, LOADED, True)

    def adapter_parameters(self, model):
        adapters = super().adapter_parameters(model)
        if not getattr(model, LOADED, False):
            return adapters
        return {name: adapters[name] for name in text_order(list(adapters))}


def cupy_text_order() -> TextOrderAfterLoad:
    return TextOrderAfterLoad("cupy")
