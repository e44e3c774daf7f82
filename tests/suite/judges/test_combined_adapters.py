"""Adapters combined by weight (``lora_suite.judges.combined_adapters``) on the CPU: PEFT's add_weighted_adapter
('cat') computes W + Σ wᵢ·sᵢ·Bᵢ·Aᵢ under rsLoRA and leaves its sources alone; stacks that hold one adapter or offer no
combination say why; a combined adapter that inherits rsLoRA (peft PR #3449), one combined with the 'linear' rule
(cross terms: (Σ√wᵢ·Bᵢ)(Σ√wᵢ·Aᵢ)) and one that rescales a source each fail their check."""

from __future__ import annotations

import math

import pytest
import torch

from lora_suite.implementations import resolve_implementation
from lora_suite.implementations.peft_impl import TUNER, PeftImplementation
from lora_suite.judges import combined_adapters as CA

pytestmark = pytest.mark.usefixtures("one_thread")
LOGITS = "combined adapters: logits beyond tolerance of W + Σ wᵢ·sᵢ·Bᵢ·Aᵢ"
SOURCES = "combined adapters: source adapters changed by the combination"


def failed(impl) -> list[str]:
    return [v.name for v in CA.judge(impl, "cpu") if not v.passed]


def test_peft_combines_exactly_under_rslora_and_keeps_its_sources():
    assert failed(resolve_implementation("peft")) == []


def test_stacks_without_the_operation_say_why():
    assert "holds one adapter" in CA.not_applicable_reason(resolve_implementation("torch"))
    assert "add_weighted_adapter" in CA.not_applicable_reason(resolve_implementation("transformers-adapter"))


class InheritsRslora(PeftImplementation):
    name = expected_path = "peft"

    def combine_adapters(self, model, names, weights, new):
        super().combine_adapters(model, names, weights, new)
        for m in self._lora_layers(model):
            m.scaling[new] = math.sqrt(m.r[new])  # alpha = r under rsLoRA: r / √r


class LinearRule(PeftImplementation):
    name = expected_path = "peft"

    def combine_adapters(self, model, names, weights, new):
        model.__dict__[TUNER].add_weighted_adapter(
            list(names), [abs(w) for w in weights], new, combination_type="linear"
        )


class SourceRescaled(PeftImplementation):
    name = expected_path = "peft"

    def combine_adapters(self, model, names, weights, new):
        super().combine_adapters(model, names, weights, new)
        with torch.no_grad():
            for m in self._lora_layers(model):
                m.lora_B[names[0]].weight.mul_(weights[0])


@pytest.mark.parametrize(
    ("plant", "check"), [(InheritsRslora, LOGITS), (LinearRule, LOGITS), (SourceRescaled, SOURCES)], ids=str
)
def test_each_planted_combination_fails_its_check(plant, check):
    assert check in failed(plant())
