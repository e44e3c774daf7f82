"""longcontext tier: LoRA at 8192 tokens (SmolLM2-135M architecture, all-linear, bf16, activation checkpointing),
where real stacks break: attention and rotary embeddings at long positions, the checkpointed recompute, kernels
whose row count is the token count, memory that grows with the tokens.

Two tests, each judged by checks the harness already has:
  gradients  step-0 adapter gradients of the whole model on one 8192-token window against an fp32 copy of it on the
             torch reference backend, the 16-bit torch reference's own error as the yardstick
             (``lora_suite.engine.gradients``, the quick tier's criterion and factor), whole batch and checkpointed;
  training   40 checkpointed steps on one fixed window: the loss falls (``lora_suite.measure.criteria.loss_drop``),
             the peak allocated memory is within ``memory_estimate_error_max`` of the estimator
             (``lora_suite.harness.memory_tier``), the served path is the one under test; its headline figures are
             the tokens per second of the GPU's work (the device time of the last steps) and the peak.

The fp32 reference's attention (``attention_without_gqa``): SmolLM2 has 9 query heads and 3 key/value heads, and
transformers' SDPA attention hands them to ``scaled_dot_product_attention`` with ``enable_gqa``. In fp32 only SDPA's
math kernel takes grouped heads (flash and cuDNN take 16-bit inputs, the memory-efficient kernel takes no GQA), and
it keeps every layer's (heads, n, n) attention weights for the backward: 9 x 8192^2 x 4 bytes = 2.25 GiB a layer,
68 GiB over 30 layers. The reference's key and value heads are therefore repeated to the query heads before SDPA
(transformers' own ``repeat_kv``, its non-GQA path), which the memory-efficient kernel takes in fp32; the function
is the same, only the kernel differs. The model under test keeps its own attention.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lora_suite.engine import gradients as G
from lora_suite.harness.figures import record_figure
from lora_suite.harness.gradient_verdicts import against_reference, judge_gradients
from lora_suite.harness.memory_tier import MemoryTier
from lora_suite.measure.criteria import loss_drop
from lora_suite.measure.device_time import DeviceTimer, window

pytestmark = [pytest.mark.gpu, pytest.mark.longcontext]
TIER = "longcontext"
ATTENTION_WITHOUT_GQA = "sdpa_kv_heads_repeated"  # the name it is registered under with transformers


class _CausalFlagOnly(torch.nn.Module):
    """An attention module as transformers' SDPA forward reads it, without ``num_key_value_groups``: its
    ``is_causal`` only."""

    def __init__(self, is_causal: bool):
        super().__init__()
        self.is_causal = is_causal


def sdpa_kv_heads_repeated(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention with the key and value heads repeated to the query heads first (module
    docstring): its own forward, given a stand-in module without ``num_key_value_groups`` so that it asks SDPA for
    no grouped-query attention, and the module's own ``is_causal``."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    plain = _CausalFlagOnly(getattr(module, "is_causal", True))
    return sdpa_attention_forward(
        plain, query, repeat_kv(key, groups), repeat_kv(value, groups), attention_mask, **kwargs
    )


def attention_without_gqa(model) -> None:
    """Give ``model`` (a transformers model with SDPA attention) ``sdpa_kv_heads_repeated``, registered with
    transformers' ``AttentionInterface``, with SDPA's own mask function; its deep copies (the fp32 reference of
    ``gradients.reference_model``) keep it."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in ("sdpa", ATTENTION_WITHOUT_GQA):
        raise ValueError(f"attention_without_gqa: the model's attention is {implementation!r}; expected 'sdpa'")
    AttentionInterface.register(ATTENTION_WITHOUT_GQA, sdpa_kv_heads_repeated)
    AttentionMaskInterface.register(ATTENTION_WITHOUT_GQA, sdpa_mask)
    model.set_attn_implementation(ATTENTION_WITHOUT_GQA)


def profiled_steps(cfg) -> list[int]:
    """The steps whose launches are timed (``lora_suite.measure.device_time``): the last ``device_window`` steps and
    the one before them, which carries CUPTI's first-use set-up and is not counted."""
    last = cfg.train.steps
    return list(range(max(0, last - cfg.criteria.device_window - 1), last))


def throughput_figure(tier, cfg, timer, records) -> None:
    """Tokens per second of the GPU's work: batch x seq_len over the median device time of the profiled steps past
    the first (each step's launch durations, a launch clipped at ``device_clip`` x its median over those steps:
    ``lora_suite.measure.device_time``), their 20th and 80th percentiles as the spread; the headline figure
    ``compare`` gates. The eager step's CUDA-event span is noted beside it: at this length it is host-bound (210
    adapted layers run forward, recomputed and backward), so the host's speed is in it and it is no figure."""
    steps = profiled_steps(cfg)[1:]
    try:
        ms = [t * 1e3 for t in window("profiled", steps, timer.launches, cfg.criteria.device_clip).clipped_s]
    except ValueError as exc:  # nothing profiled (no CUPTI)
        tier.report.notes.append(f"{tier.nodeid}: device time not measured ({exc}): no throughput figure")
        return
    p20, med, p80 = (float(v) for v in np.percentile(ms, [20, 50, 80]))
    tokens = cfg.data.batch_size * cfg.data.seq_len
    spans = [r.gpu_time_s * 1e3 for r in records if r.step in steps and r.gpu_time_s is not None]
    span = f"; eager step span {float(np.median(spans)):.1f} ms" if spans else ""
    tier.report.notes.append(
        f"{tier.nodeid}: device time per step {med:.1f} ms (median of {len(ms)} profiled steps), {tokens} tokens{span}"
    )
    name = "tokens per second (device time)"
    rate, low, high = tokens / (med / 1e3), tokens / (p80 / 1e3), tokens / (p20 / 1e3)
    record_figure(tier.report, tier.nodeid, TIER, name, rate, p20=low, p80=high, samples=len(ms))


def test_gradients_at_8192_tokens_match_the_fp32_reference(tier):
    cfg = tier.config(TIER)
    crit = cfg.criteria
    prepared = tier.prepare(cfg)
    G.randomize_lora_b(prepared.model, std=0.02, seed=cfg.train.seed, adapters=prepared.adapters)
    reference = tier.prepare(cfg, implementation="torch")  # same seed: the same base weights
    G.copy_adapters(reference.adapters, {n: p.detach() for n, p in prepared.adapters.items()})
    attention_without_gqa(reference.model)  # and so its fp32 copy (module docstring)
    assert not torch.backends.cuda.matmul.allow_tf32, "the fp32 reference must not run in TF32"
    results = against_reference(
        prepared, reference, prepared.batches(0), f"{tier.impl.name} at {cfg.data.seq_len} tokens", crit
    )
    tier.check_served(prepared)
    judge_gradients(tier, results, crit, TIER)


def test_checkpointed_training_at_8192_tokens(tier):
    cfg = tier.config(TIER)
    crit = cfg.criteria
    memory = MemoryTier(tier)
    timer = DeviceTimer(profiled_steps(cfg))
    # run_and_measure also checks the served path (check_served)
    peak, split, records = memory.run_and_measure(cfg, cfg.lora.quantize, device_timer=timer)
    memory.record_split(cfg, TIER, peak, split)
    memory.check_peak_vs_estimate(cfg, peak)
    record_figure(tier.report, tier.nodeid, TIER, "peak GPU memory", peak / 2**30)
    throughput_figure(tier, cfg, timer, records)
    drop = loss_drop([r.loss for r in records], crit.loss_window)
    tier.check(
        f"loss drop, mean of first {crit.loss_window} vs last {crit.loss_window} steps",
        round(drop, 4),
        ">=",
        crit.loss_drop_min,
        source=f"configs/{TIER}.yaml loss_drop_min",
    )
