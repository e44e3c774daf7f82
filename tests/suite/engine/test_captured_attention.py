"""The captured step's attention (lora_suite.engine.capture.causal_attention_for_capture) on the CPU: the mask is left
out only where it is exactly causal, everything else gets transformers' own SDPA mask, and the model's outputs are
the SDPA model's, with and without padding; a model whose attention is not SDPA is left alone."""

from __future__ import annotations

import pytest
import torch
from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

from lora_suite.engine import capture as C
from lora_suite.engine.models import TINY_LLAMA, build_random


def _llama(attn: str = "sdpa"):
    """The suite's tiny Llama (SDPA attention, as ``build_random`` makes it), or with ``attn`` set instead."""
    model = build_random(TINY_LLAMA, torch.float32, "cpu", seed=0).eval()
    if attn != "sdpa":
        model.set_attn_implementation(attn)
    return model


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def test_a_plain_causal_mask_is_left_out():
    assert C.causal_mask_or_none(2, 9, 9, mask_function=causal_mask_function) is None
    assert C.causal_mask_or_none(2, 9, 9) is None  # the default pattern is the causal one


@pytest.mark.parametrize(
    "kwargs",
    [
        {"attention_mask": torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)},
        {"local_size": 2, "mask_function": sliding_window_causal_mask_function(2)},
        {"mask_function": sliding_window_causal_mask_function(2)},
        {"allow_is_causal_skip": False},
        {"q_offset": 1, "kv_offset": 0},
    ],
    ids=["padding", "local window", "another pattern", "skip not allowed", "offset"],
)
def test_anything_but_the_plain_causal_mask_is_transformers_own(kwargs):
    # transformers' own may itself leave a mask out (not capturing here): the same answer either way
    full = {"mask_function": causal_mask_function, **kwargs}
    assert _same(C.causal_mask_or_none(2, 4, 4, **kwargs), sdpa_mask(2, 4, 4, **full))


def test_queries_shorter_than_keys_get_transformers_mask():
    for q, kv in ((1, 4), (2, 4), (3, 4)):
        assert _same(C.causal_mask_or_none(1, q, kv), sdpa_mask(1, q, kv))


def test_the_model_computes_what_the_sdpa_model_computes():
    ref, model = _llama(), _llama()
    assert C.causal_attention_for_capture(model) == C.CAPTURED_ATTENTION
    assert model.config._attn_implementation == C.CAPTURED_ATTENTION
    x = torch.randint(0, TINY_LLAMA.vocab_size, (2, 9))
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[0, :3] = 0
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, ref(input_ids=x).logits)
        assert torch.equal(model(input_ids=x, attention_mask=pad).logits, ref(input_ids=x, attention_mask=pad).logits)
    assert C.causal_attention_for_capture(model) == C.CAPTURED_ATTENTION  # set again: unchanged


def test_a_model_whose_attention_is_not_sdpa_is_left_alone():
    model = _llama("eager")
    assert C.causal_attention_for_capture(model) is None
    assert model.config._attn_implementation == "eager"
    assert C.causal_attention_for_capture(torch.nn.Linear(2, 2)) is None
