"""The training loop of every tier: AdamW over the adapters only, warm-up then decay, accumulation, records.

One visible loop (``train``). Each optimizer step records loss, gradient norm, learning rate, tokens/s,
step time and memory (torch allocated / reserved / peak, NVML used). A non-finite loss or gradient stops
the run with ``NonFiniteError`` naming the offending parameters, instead of training on NaN.

Learning rate at step t (0-based) with warm-up w, total T, peak η and floor ratio m:
    t < w:        η·(t+1)/w
    cosine:       η·(m + (1−m)·½(1 + cos(π·p))),   p = (t−w)/(T−w−1)   (p = 1 at the last step)
    linear:       η·(1 − (1−m)·p)
    constant:     η
"""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from lora_core.config import TrainSettings
from lora_core.inject import adapter_parameters
from lora_core.memory import MIB, NvmlReader

log = logging.getLogger("lora_core.trainer")


class NonFiniteError(FloatingPointError):
    """Loss or gradients became NaN/Inf; the message names the step and the parameters."""


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens_per_s: float
    step_time_s: float
    allocated_mib: float
    reserved_mib: float
    peak_allocated_mib: float
    nvml_used_mib: float | None


@dataclass
class TrainResult:
    records: list[StepRecord]
    optimizer: torch.optim.Optimizer

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]


def lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    if s.schedule == "constant":
        return s.lr
    p = min(1.0, (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps - 1))
    if s.schedule == "cosine":
        return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))
    return s.lr * (1 - (1 - s.min_lr_ratio) * p)


def make_optimizer(model: nn.Module, s: TrainSettings,
                   adapters: dict[str, nn.Parameter] | None = None) -> torch.optim.AdamW:
    """AdamW over exactly the adapter parameters; any other trainable parameter is an error.

    ``adapters`` defaults to the model's LoRALinear adapters; pass another model's (PEFT's) explicitly.
    """
    adapters = adapter_parameters(model) if adapters is None else adapters
    if not adapters:
        raise ValueError("the model has no LoRA adapters (inject_lora first)")
    adapter_ids = {id(p) for p in adapters.values()}
    stray = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in adapter_ids]
    if stray:
        raise ValueError(f"parameters outside the adapters require grad: {stray[:5]} ({len(stray)} in all); "
                         "the base model must be frozen")
    params = list(adapters.values())
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=s.weight_decay,
                             fused=fused or None)


def train(model: nn.Module, batches: Callable[[int], dict[str, torch.Tensor]], s: TrainSettings, *,
          optimizer: torch.optim.Optimizer | None = None, start_step: int = 0, stop_step: int | None = None,
          adapters: dict[str, nn.Parameter] | None = None) -> TrainResult:
    """Run optimizer steps ``start_step .. stop_step`` (default: to ``s.steps``); batches(i) gives micro-batch i."""
    stop_step = s.steps if stop_step is None else stop_step
    named = adapter_parameters(model) if adapters is None else adapters
    optimizer = optimizer or make_optimizer(model, s, named)
    params = list(named.values())
    cuda = params[0].is_cuda
    if s.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    nvml = NvmlReader() if cuda else None
    records: list[StepRecord] = []
    # Move the model's large object graph out of the cyclic collector's reach: a full collection over it
    # stalls a step for hundreds of ms (seen once in an extended-tier run on the H200), which is noise in
    # step-time statistics, not a property of the kernels under test.
    gc.collect()
    gc.freeze()
    try:
        for step in range(start_step, stop_step):
            t0 = time.perf_counter()
            lr = lr_at(step, s)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), device=params[0].device)
            n_tokens = 0
            for micro in range(s.grad_accum):
                batch = batches(step * s.grad_accum + micro)
                out = model(input_ids=batch["input_ids"], labels=batch["labels"])
                (out.loss / s.grad_accum).backward()
                loss_sum += out.loss.detach()
                n_tokens += batch["input_ids"].numel()
            max_norm = s.max_grad_norm if s.max_grad_norm is not None else math.inf
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))  # syncs
            loss = float(loss_sum) / s.grad_accum
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise NonFiniteError(_non_finite_message(step, loss, grad_norm, named))
            optimizer.step()
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            nvml_used = nvml.used() if nvml is not None else None
            rec = StepRecord(
                step=step, loss=loss, grad_norm=grad_norm, lr=lr, tokens_per_s=n_tokens / dt,
                step_time_s=dt,
                allocated_mib=torch.cuda.memory_allocated() / MIB if cuda else 0.0,
                reserved_mib=torch.cuda.memory_reserved() / MIB if cuda else 0.0,
                peak_allocated_mib=torch.cuda.max_memory_allocated() / MIB if cuda else 0.0,
                nvml_used_mib=None if nvml_used is None else nvml_used / MIB,
            )
            records.append(rec)
            if (step + 1) % s.log_every == 0 or step == stop_step - 1 or step == start_step:
                log.info("step %d/%d loss %.4f grad_norm %.3g lr %.2e %.0f tok/s %.0f ms alloc %.2f GiB nvml %s",
                         step + 1, s.steps, loss, grad_norm, lr, rec.tokens_per_s, dt * 1e3, rec.allocated_mib / 1024,
                         "-" if rec.nvml_used_mib is None else f"{rec.nvml_used_mib / 1024:.2f} GiB")
    finally:
        gc.unfreeze()
        if nvml is not None:
            nvml.close()
        model.eval()
    return TrainResult(records, optimizer)


def _non_finite_message(step: int, loss: float, grad_norm: float, named: dict[str, nn.Parameter]) -> str:
    """Name the adapters whose values are non-finite (the usual root cause) and those whose gradients are."""
    values = [n for n, p in named.items() if not torch.isfinite(p).all()]
    grads = [n for n, p in named.items() if p.grad is not None and not torch.isfinite(p.grad).all()]
    return (f"non-finite values at step {step}: loss {loss}, grad norm {grad_norm}; adapters with NaN/Inf values: "
            f"{values[:10]}{' ...' if len(values) > 10 else ''}; adapters with NaN/Inf gradients: {grads[:10]}"
            f"{' ...' if len(grads) > 10 else ''} ({len(grads)} of {len(named)})")
