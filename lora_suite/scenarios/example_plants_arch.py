"""Planted defects of the architecture class (issue 55): copies of the shipped example that are right on every
bias-free Llama-shaped model and wrong on a model whose projections carry a bias (Qwen2's q/k/v). Each factory is
``--lora-impl lora_suite.scenarios.example_plants:<name>`` (example_plants re-exports them) and ``PLANTS`` (in
``example_plant_table``) names the check of ``lora_suite.tiers.quick.test_architectures`` that must catch it.
"""

from __future__ import annotations

import torch.nn.functional as F

from lora_suite.scenarios.example_plant_base import _example, _forward_plant, _lora, _planted


def _bias_dropped(self, x):
    """The base term written as ``F.linear(x, base.weight)``: the base layer's bias is lost."""
    self.calls += 1
    a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
    return F.linear(x, self.base.weight) + self.scale * _lora(self, x, a, b)


base_bias_dropped = _forward_plant("base_bias_dropped", _bias_dropped)


def base_bias_left_trainable():
    """inject freezes the base weights but leaves each adapted layer's bias trainable (a loop that freezes
    ``.weight`` by name): an optimizer over ``model.parameters()`` then trains the biases too."""

    def inject(self, model, spec):
        adapted = _example().PlainLoRA.inject(self, model, spec)
        for m in self.layers(model).values():
            if m.base.bias is not None:
                m.base.bias.requires_grad_(True)
        return adapted

    return _planted("base_bias_left_trainable", inject=inject)
