"""Route a causal LM's training loss through the fused linear cross-entropy: ``fuse_loss(model)``.

A training forward with labels (``model.training`` and ``labels`` given) runs the decoder (``model.model``), then
``lora_core.ops.linear_cross_entropy`` over its last hidden states, ``model.lm_head.weight`` and the labels shifted
as transformers shifts them (target i = label i + 1, the last position ``-100``; ``shift_labels`` used as given):
the loss is transformers' token mean (or the sum over ``num_items_in_batch``), and no logits are returned
(``logits`` is None), as in Liger-Kernel's and Unsloth's fused losses. Every other call (evaluation, generation, no
labels) runs the model's own forward: ``LossHead`` counts both kinds, and ``loss_path(model)`` says which served the
last training loss, so a report can prove the fused loss ran.

Refused by name (``FuseError``), never run unfused: a model without ``model`` and an ``lm_head`` linear, a head with a
bias or adapted by LoRA, and a config that scales the logits after the head (``logit_scale``, ``logits_scaling``),
which this loss does not apply. Gemma 2's ``final_logit_softcapping`` c is applied: the logits are c·tanh(z / c).
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from typing import cast

from torch import nn
from torch.nn import functional as F

from lora_core.backend import resolve_backend
from lora_core.fuse import FuseError
from lora_core.ops.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy

LOGIT_TRANSFORMS = ("logit_scale", "logits_scaling")  # not applied here: refused (the soft cap is applied)


@dataclasses.dataclass
class LossHead:
    """What ``fuse_loss`` installed and what it has served: training losses fused (``calls``, the backend of the
    last in ``last_backend``) and forwards passed to the model's own (``passed``)."""

    chunk_rows: int | None
    backend: str | None
    output: type  # transformers' CausalLMOutputWithPast, looked up once when installed
    calls: int = 0
    passed: int = 0
    last_backend: str | None = None


def fuse_loss(model: nn.Module, *, chunk_rows: int | None = None, backend: str | None = "cupy") -> LossHead:
    """Install the fused loss on ``model`` (module docstring); returns its ``LossHead``. ``backend``: "cupy" (the
    system under test), "torch" (the same plan on torch ops) or None (resolved per call)."""
    if isinstance(getattr(model, "_lora_core_loss", None), LossHead):
        raise FuseError("fuse_loss: the model's loss is already fused (a second fuse_loss would wrap it twice)")
    head, decoder = getattr(model, "lm_head", None), getattr(model, "model", None)
    if type(head) is not nn.Linear or not isinstance(decoder, nn.Module):
        raise FuseError(
            f"fuse_loss: {type(model).__name__} has lm_head {type(head).__name__} and model "
            f"{type(decoder).__name__}; expected a causal LM with a decoder ``model`` and an nn.Linear ``lm_head``"
        )
    if head.bias is not None:
        raise FuseError("fuse_loss: lm_head has a bias, which the fused linear cross-entropy does not add")
    config = getattr(model, "config", None)
    transforms = {k: getattr(config, k) for k in LOGIT_TRANSFORMS if getattr(config, k, None) not in (None, 1, 1.0)}
    if transforms:
        raise FuseError(f"fuse_loss: the config transforms the logits after the head ({transforms}); not applied here")
    output = importlib.import_module("transformers.modeling_outputs").CausalLMOutputWithPast
    state = LossHead(chunk_rows, backend, output)
    model._lora_core_loss = state
    # a bound method, not a closure: copy.deepcopy rebinds it to the copy (a closure would run the original model)
    model.forward = types.MethodType(_fused_forward, model)
    return state


def _fused_forward(model: nn.Module, *args, labels=None, **kwargs):
    """The installed forward (module docstring): the fused loss for a training forward with labels, else the model's
    own forward (its class's)."""
    state = loss_head(model)
    assert state is not None, "the fused forward is installed together with its LossHead (fuse_loss)"
    # fuse_loss checked both before it installed this forward: a decoder module ``model``, an nn.Linear ``lm_head``
    decoder, head = cast(nn.Module, model.model), cast(nn.Linear, model.lm_head)
    if args or labels is None or not model.training:
        state.passed += 1
        return type(model).forward(model, *args, labels=labels, **kwargs)
    num_items = kwargs.pop("num_items_in_batch", None)
    shifted = kwargs.pop("shift_labels", None)
    kwargs.pop("logits_to_keep", None)
    out = decoder(**kwargs)
    hidden = out[0]
    targets = shifted if shifted is not None else F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    name = resolve_backend(state.backend, hidden.device)
    loss = linear_cross_entropy(
        hidden,
        head.weight,
        targets,
        num_items=num_items,
        chunk_rows=state.chunk_rows,
        softcap=getattr(getattr(model, "config", None), "final_logit_softcapping", None),
        backend=name,
    )
    state.calls, state.last_backend = state.calls + 1, name
    return state.output(
        loss=loss,
        logits=None,
        hidden_states=getattr(out, "hidden_states", None),
        attentions=getattr(out, "attentions", None),
    )


def loss_head(model: nn.Module) -> LossHead | None:
    """The model's ``LossHead``, or None where ``fuse_loss`` was not applied."""
    state = getattr(model, "_lora_core_loss", None)
    return state if isinstance(state, LossHead) else None


def loss_path(model: nn.Module) -> str:
    """Which loss served the last training step: "cupy-fused-loss" (or "torch-fused-loss"), "fused loss installed,
    not run yet", or "the model's own loss" where ``fuse_loss`` was not applied."""
    state = loss_head(model)
    if state is None:
        return "the model's own loss"
    if state.last_backend is None:
        return "fused loss installed, not run yet"
    return f"{state.last_backend}-fused-loss"


def unfuse_loss(model: nn.Module) -> None:
    """Put the model's own forward back (the instance attribute ``fuse_loss`` set is removed)."""
    if loss_head(model) is not None:
        del model.forward
        del model._lora_core_loss
