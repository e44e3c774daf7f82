"""The optimizer side of a training step: AdamW over exactly the adapters, the learning-rate schedule, clipping.

Learning rate at step t (0-based) with warm-up w, total T, peak η and floor ratio m:
    t < w:        η·(t+1)/w
    cosine:       η·(m + (1−m)·½(1 + cos(π·p))),   p = (t−w)/(T−w−1)   (p = 1 at the last step)
    linear:       η·(1 − (1−m)·p)
    constant:     η

Captured steps (trainer.py) need a capturable AdamW whose lr is a device tensor: ``set_lr`` writes into it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lora_core.adapters import full_tensor
from lora_core.inject import adapter_parameters
from lora_suite.settings.config import TrainSettings


def lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    if s.schedule == "constant":
        return s.lr
    p = min(1.0, (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps - 1))
    if s.schedule == "cosine":
        return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))
    return s.lr * (1 - (1 - s.min_lr_ratio) * p)


def make_optimizer(
    model: nn.Module, s: TrainSettings, adapters: dict[str, nn.Parameter] | None = None
) -> torch.optim.AdamW:
    """AdamW over exactly the adapter parameters; any other trainable parameter is an error.

    ``adapters`` defaults to the model's LoRALinear adapters; pass another model's (PEFT's) explicitly.
    """
    adapters = adapter_parameters(model) if adapters is None else adapters
    if not adapters:
        raise ValueError("the model has no LoRA adapters (inject_lora first)")
    adapter_ids = {id(p) for p in adapters.values()}
    stray = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in adapter_ids]
    if stray:
        raise ValueError(
            f"parameters outside the adapters require grad: {stray[:5]} ({len(stray)} in all); "
            "the base model must be frozen"
        )
    params = list(adapters.values())
    # The fused kernel for plain CUDA tensors; a sharded model's DTensor adapters take torch's default
    # (foreach) implementation, which DTensor supports.
    fused = all(p.is_cuda and not _is_dtensor(p) for p in params)
    if s.cuda_graph:  # capturable: the step count and the lr live on the device, so a replay can update them
        check_capturable(params)
        return torch.optim.AdamW(
            params,
            lr=torch.tensor(s.lr, device=params[0].device),
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=s.weight_decay,
            fused=True,
            capturable=True,
        )
    return torch.optim.AdamW(
        params, lr=s.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=s.weight_decay, fused=fused or None
    )


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def check_capturable(params: list[nn.Parameter]) -> None:
    """The errors a captured run gives before it starts, naming what is wrong."""
    if any(not p.is_cuda for p in params):
        devices = sorted({str(p.device) for p in params})
        raise ValueError(f"train.cuda_graph: true needs the adapters on a CUDA device; they are on {devices}")


def clip_gradients(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients to a total 2-norm of ``max_norm`` (inf: no clipping); return the norm before clipping.

    What ``torch.nn.utils.clip_grad_norm_`` does (the same two calls), except that a sharded model's norm
    (FSDP2: DTensor gradients, so a partial norm per rank) is completed across the ranks before it is used,
    so every rank clips by the global norm and returns it.
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = full_tensor(torch.nn.utils.get_total_norm(grads, 2.0))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write ``lr`` into every group: in place into a tensor lr (a captured step reads it), else assigned."""
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
