"""What a non-finite training step names (``lora_suite.engine.trainer``'s guard raises ``NonFiniteError`` with it):
the adapters whose values or gradients hold NaN/Inf, the frozen base's tensors that do (then the adapters are not
the cause), and the micro-batches without one target token (their mean loss is 0/0)."""

from __future__ import annotations

import torch
from torch import nn


def non_finite_message(
    step: int, loss: float, grad_norm: float, named: dict[str, nn.Parameter], model=None, micro=None
) -> str:
    """Name what is non-finite: the adapters' values and gradients, the frozen base's tensors (then the adapters are
    not the cause), and a batch without one target token (its mean loss is 0/0)."""
    values = [n for n, p in named.items() if not torch.isfinite(p).all()]
    grads = [n for n, p in named.items() if p.grad is not None and not torch.isfinite(p.grad).all()]
    msg = (
        f"non-finite values at step {step}: loss {loss}, grad norm {grad_norm}; adapters with NaN/Inf values: "
        f"{values[:10]}{' ...' if len(values) > 10 else ''}; adapters with NaN/Inf gradients: {grads[:10]}"
        f"{' ...' if len(grads) > 10 else ''} ({len(grads)} of {len(named)})"
    )
    if model is not None:
        mine = {id(p) for p in named.values()}
        frozen = [
            n
            for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if id(t) not in mine and t.is_floating_point() and not torch.isfinite(t).all()
        ]
        if frozen:
            msg += f"; the frozen base holds NaN/Inf in {frozen[:5]} ({len(frozen)} tensors): not the adapters' doing"
    empty = [i for i, b in enumerate(micro or []) if "labels" in b and not bool((b["labels"][..., 1:] != -100).any())]
    if empty:
        msg += f"; micro-batch(es) {empty} have no target token (every label is -100): their mean loss is 0/0"
    return msg
