"""``settings.tier_rules.target_shapes``: a projection's shape uses the family's head width where it sets one
(Gemma 2: 256, not hidden / heads = 288), so the rank bound is the model's own."""

from __future__ import annotations

from lora_suite.settings.loader import load_model_config
from lora_suite.settings.tier_rules import target_shapes


def test_gemma_2_projections_use_its_head_width():
    a = load_model_config("gemma-2-2b").architecture  # hidden 2304, 8 heads, 4 kv heads, head width 256
    shapes = target_shapes(a, ("q_proj", "k_proj", "o_proj"))
    assert shapes == {"q_proj": (2304, 8 * 256), "k_proj": (2304, 4 * 256), "o_proj": (8 * 256, 2304)}


def test_a_llama_without_a_set_head_width_uses_hidden_over_heads():
    a = load_model_config("smollm2-135m").architecture
    assert target_shapes(a, ("q_proj",))["q_proj"] == (a.hidden_size, a.hidden_size)
