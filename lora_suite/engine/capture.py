"""What a training step captured in a CUDA graph needs from the model and its inputs: static input buffers
(every replay reads the same addresses, so micro-batches are copied in and must keep the captured shapes), and
activation checkpointing that a graph can record (non-reentrant, no RNG stash), which refuses a model that draws
random numbers in training mode, naming what draws them."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from lora_suite.settings.config import TrainSettings

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def checkpointing_kwargs(model: nn.Module, s: TrainSettings) -> dict[str, bool]:
    """How activations are checkpointed: non-reentrant, and, when the step is captured, without RNG stashing.

    Non-reentrant checkpointing (saved-tensor hooks; the recomputation runs inside backward) is what a
    CUDA graph can record: the recomputed forward is just more kernels in the captured backward. What it
    cannot record is the RNG stash (``preserve_rng_state``: reading and restoring the CUDA generator state
    on the host at every checkpointed block, which reads capture-time values). That stash exists to
    replay dropout masks exactly; a model with no random op in training mode has none to replay, so under
    capture it is turned off, after checking that nothing in the model draws random numbers, and a model
    that does is refused with the modules named.
    """
    kwargs = {"use_reentrant": False}
    if s.cuda_graph:
        random_ops = random_in_training(model)
        if random_ops:
            raise ValueError(
                "train.cuda_graph: true with train.gradient_checkpointing: true needs a model without "
                f"dropout in training mode (the checkpoint's RNG stash cannot be captured); found "
                f"{random_ops[:5]}{' ...' if len(random_ops) > 5 else ''}: set their p to 0 or turn "
                "one of the two settings off"
            )
        kwargs["preserve_rng_state"] = False
    return kwargs


def random_in_training(model: nn.Module) -> list[str]:
    """What draws random numbers in training mode: dropout modules with p > 0 and the config's dropout rates."""
    found = [
        f"{n or type(model).__name__} (p={m.p})"
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
    ]
    config = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        value = getattr(config, key, None) if config is not None else None
        if isinstance(value, (int, float)) and value > 0:
            found.append(f"config.{key}={value}")
    return found


class StaticBatches:
    """The captured step's input buffers: micro-batches are copied in, and must keep the captured shapes."""

    def __init__(self, micro: list[dict[str, torch.Tensor]]):
        self.buffers = [{k: v.clone() for k, v in b.items()} for b in micro]

    def load(self, micro: list[dict[str, torch.Tensor]], step: int) -> list[dict[str, torch.Tensor]]:
        if len(micro) != len(self.buffers):
            raise ValueError(f"step {step}: {len(micro)} micro-batches, the captured step has {len(self.buffers)}")
        for i, (buf, b) in enumerate(zip(self.buffers, micro)):
            if buf.keys() != b.keys():
                raise ValueError(f"step {step}, micro-batch {i}: keys {sorted(b)}, captured {sorted(buf)}")
            for k, v in b.items():
                if v.shape != buf[k].shape or v.dtype != buf[k].dtype:
                    raise ValueError(
                        f"step {step}, micro-batch {i}: {k} is {tuple(v.shape)} {v.dtype}, the captured "
                        f"step takes {tuple(buf[k].shape)} {buf[k].dtype} (cuda_graph needs static "
                        "shapes: a fixed batch size and seq_len)"
                    )
                buf[k].copy_(v, non_blocking=True)
        return self.buffers


CAPTURED_ATTENTION = "sdpa_causal_in_capture"


def causal_mask_or_none(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs,
) -> torch.Tensor | None:
    """transformers' SDPA mask function (``masking_utils.sdpa_mask``), except that a plain causal mask over a batch
    without padding is left out (None: SDPA's ``is_causal``) whether or not a CUDA stream is capturing.

    transformers up to 5.17 (``_ignore_causal_mask_sdpa``) builds the full (batch, 1, q, kv) mask whenever a stream
    captures, even with no padding mask to read; SDPA then takes its masked kernels (the captured profile measured
    cuDNN's flash attention 2.3-2.7x slower with the mask, ``lora-suite bench -- -k captured_profile``). The mask is
    left out only where it is exactly causal: no padding mask, no local window, the causal pattern itself, queries and
    keys the same positions (no cache); anything else goes to ``sdpa_mask`` unchanged."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = causal_mask_function if mask_function is None else mask_function
    plain = attention_mask is None and local_size is None and mask_function is causal_mask_function
    aligned = q_length == kv_length and isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0
    if allow_is_causal_skip and plain and aligned:
        return None
    return sdpa_mask(
        batch_size,
        q_length,
        kv_length,
        q_offset,
        kv_offset,
        mask_function,
        attention_mask,
        local_size,
        allow_is_causal_skip,
        **kwargs,
    )


def causal_attention_for_capture(model: nn.Module) -> str | None:
    """Give a model whose attention is SDPA the attention ``CAPTURED_ATTENTION``: SDPA's own forward with
    ``causal_mask_or_none`` as its mask function (registered with transformers' ``AttentionInterface`` and
    ``AttentionMaskInterface``), so that its captured step runs the causal kernels its eager step runs. Returns the
    implementation set, or None where the model's attention is not SDPA (eager, flash: left as they are)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) not in ("sdpa", CAPTURED_ATTENTION):
        return None
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CAPTURED_ATTENTION, sdpa_attention_forward)
    AttentionMaskInterface.register(CAPTURED_ATTENTION, causal_mask_or_none)
    # a config with an attention implementation: a transformers model
    cast("PreTrainedModel", model).set_attn_implementation(CAPTURED_ATTENTION)
    return CAPTURED_ATTENTION
