"""The longcontext tier's own pieces (``lora_suite/tiers/longcontext/test_longcontext_tier.py``) on the CPU: the fp32
reference's attention without grouped-query SDPA computes the same function on a tiny GQA Llama (and its deep copy
keeps it), and the throughput figure is the tokens over the median device time of the last profiled steps."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from lora_suite.engine.models import build_tiny_llama
from lora_suite.harness.report import RunReport
from lora_suite.measure.device_time import DeviceTimer
from lora_suite.settings.environment import collect_environment
from lora_suite.tiers.longcontext.test_longcontext_tier import (
    ATTENTION_WITHOUT_GQA,
    attention_without_gqa,
    profiled_steps,
    throughput_figure,
)


def _sdpa_calls(monkeypatch) -> list[tuple[int, int, bool, bool]]:
    """Record (query heads, key heads, enable_gqa, is_causal) of every ``scaled_dot_product_attention`` call."""
    calls: list[tuple[int, int, bool, bool]] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, *args, **kwargs):
        gqa, causal = bool(kwargs.get("enable_gqa", False)), bool(kwargs.get("is_causal", False))
        calls.append((query.shape[1], key.shape[1], gqa, causal))
        return real(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return calls


def _logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def test_the_reference_attention_repeats_the_kv_heads_and_computes_the_same_function(monkeypatch):
    model = build_tiny_llama(torch.float32, "cpu", seed=3)  # 4 query heads, 2 key/value heads: grouped
    assert model.config.num_attention_heads > model.config.num_key_value_heads
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    calls = _sdpa_calls(monkeypatch)
    plain_logits, plain_grads = _logits_and_grads(model, ids)
    reference = copy.deepcopy(model)
    attention_without_gqa(reference)
    calls.clear()
    ref_logits, ref_grads = _logits_and_grads(copy.deepcopy(reference), ids)  # a deep copy keeps it (the fp32 copy)
    heads = model.config.num_attention_heads
    # each layer: as many key heads as query heads, no grouped-query SDPA, causal by SDPA's flag (no mask built)
    assert calls == [(heads, heads, False, True)] * model.config.num_hidden_layers
    torch.testing.assert_close(ref_logits, plain_logits, rtol=1e-5, atol=1e-5)
    assert ref_grads.keys() == plain_grads.keys() and ref_grads
    for name, g in ref_grads.items():
        torch.testing.assert_close(g, plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert reference.config._attn_implementation == ATTENTION_WITHOUT_GQA


def test_a_model_without_sdpa_attention_is_refused_by_name():
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="eager"))
    with pytest.raises(ValueError, match="attention is 'eager'; expected 'sdpa'"):
        attention_without_gqa(model)


def _tier():
    return SimpleNamespace(report=RunReport("r", "longcontext", collect_environment()), nodeid="t")


def _cfg():
    return SimpleNamespace(
        data=SimpleNamespace(batch_size=1, seq_len=8192),
        train=SimpleNamespace(steps=40),
        criteria=SimpleNamespace(device_window=10, device_clip=2.0),
    )


def test_the_last_device_window_steps_are_profiled_after_one_that_sets_cupti_up():
    assert profiled_steps(_cfg()) == list(range(29, 40))
    short = _cfg()
    short.train.steps = 8
    assert profiled_steps(short) == list(range(8))


def test_the_throughput_figure_is_the_tokens_over_the_median_device_time_of_the_profiled_steps():
    cfg = _cfg()
    timer = DeviceTimer(profiled_steps(cfg))
    step_ms = [900.0] + [100.0, 101.0, 99.0, 102.0, 98.0, 100.0, 100.5, 99.5, 100.0, 100.0]  # CUPTI's first step
    timer.launches = {s: [("gemm", ms * 500.0), ("gemm", ms * 500.0)] for s, ms in zip(profiled_steps(cfg), step_ms)}
    records = [SimpleNamespace(step=s, gpu_time_s=0.35) for s in range(40)]
    tier = _tier()
    throughput_figure(tier, cfg, timer, records)
    (fig,) = tier.report.figures
    assert (fig.name, fig.unit, fig.clock, fig.better, fig.samples) == (
        "tokens per second (device time)",
        "tokens/s",
        "device",
        "higher",
        10,
    )
    assert fig.value == pytest.approx(8192 / 0.100) and fig.p20 < fig.value < fig.p80 < 8192 / 0.099
    assert (
        "device time per step 100.0 ms (median of 10 profiled steps), 8192 tokens; eager step span 350.0 ms"
        in (tier.report.notes[0])
    )


def test_nothing_profiled_records_no_figure_and_says_so():
    tier = _tier()
    throughput_figure(tier, _cfg(), DeviceTimer([]), [])
    assert tier.report.figures == [] and "device time not measured" in tier.report.notes[0]
