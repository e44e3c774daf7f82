"""Whole-model gradient checks on the CPU: tiny Llama in fp32 judged against its fp64 copy.

Each planted defect below is a bug class that passed every tier before issue 8; the check must catch it.
"""

from __future__ import annotations

import pytest
import torch

from lora_suite.engine import gradients as G
from lora_suite.engine import trainer
from lora_suite.engine.prepare import prepare

FACTOR = 4.0  # the quick tier's grad_match_factor (configs/quick.yaml)


@pytest.fixture
def setup(tiny_cfg):
    p = prepare(tiny_cfg, "cpu")
    G.randomize_lora_b(p.model, std=0.1)
    batch = p.batches(0)
    labels = batch["labels"].clone()
    labels[0, :20] = -100  # prompt-masked rows: the micro-batches carry unequal numbers of loss tokens
    labels[1, :5] = -100
    batch = {"input_ids": batch["input_ids"], "labels": labels}
    ref = G.adapter_gradients(G.reference_model(p.model, torch.float64), [batch])
    base = G.adapter_gradients(p.model, [batch])
    return p.model, batch, ref, G.relative_errors(base, ref)


def _verdicts(model, micro, ref, base_err):
    return G.agreement(G.relative_errors(G.adapter_gradients(model, micro), ref), base_err, FACTOR)


def test_accumulated_micro_batches_match_one_batch(setup):
    model, batch, ref, base_err = setup
    rows = _verdicts(model, G.split_batch(batch, 2), ref, base_err)
    assert all(r.ok for r in rows), G.describe_failures(rows)


def test_accumulated_loss_is_the_full_batch_loss(setup):
    model, batch, ref, _ = setup
    accumulated = G.adapter_gradients(model, G.split_batch(batch, 2))
    assert accumulated.loss == pytest.approx(ref.loss, rel=1e-5)


def _unweighted(model, micro_batches):
    """The old trainer: each micro-batch's mean loss divided by k (wrong when token counts differ)."""
    total = None
    for b in micro_batches:
        loss = model(input_ids=b["input_ids"], labels=b["labels"]).loss / len(micro_batches)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def _not_divided(model, micro_batches):
    """The classic bug: k micro-batch losses summed, never divided by k."""
    total = None
    for b in micro_batches:
        loss = model(input_ids=b["input_ids"], labels=b["labels"]).loss
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


@pytest.mark.parametrize("bug", [_unweighted, _not_divided], ids=["divide-by-k-on-masked-data", "no-division"])
def test_planted_accumulation_bugs_are_caught_and_named(setup, monkeypatch, bug):
    model, batch, ref, base_err = setup
    monkeypatch.setattr(trainer, "accumulate_gradients", bug)
    rows = _verdicts(model, G.split_batch(batch, 2), ref, base_err)
    message = G.describe_failures(rows)
    assert not all(r.ok for r in rows)
    assert "lora_A" in message or "lora_B" in message


def test_checkpointing_gives_the_same_gradients(setup):
    model, batch, ref, base_err = setup
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rows = _verdicts(model, [batch], ref, base_err)
    assert all(r.ok for r in rows), G.describe_failures(rows)


def test_a_stale_activation_shared_between_layers_is_caught(setup, monkeypatch):
    """Planted: every LoRA layer of one input width computes dA from the first such layer's input."""
    from lora_core.ops import lora_linear as op

    model, batch, ref, base_err = setup
    stale: dict = {}
    F = torch.nn.functional

    def stale_x(x, weight, a, b, scale):
        first = stale.setdefault(x.shape, x.detach())
        ac = a.to(x.dtype)
        h_true = F.linear(x, ac.detach())  # the value (and the dx path) from this layer's input
        h_stale = F.linear(first, ac)  # dA from the first layer's input, as a shared saved activation would
        h = h_true + h_stale - h_stale.detach()
        return F.linear(x, weight) + scale * F.linear(h, b.to(x.dtype))

    monkeypatch.setattr(op, "lora_linear_torch", stale_x)
    rows = _verdicts(model, [batch], ref, base_err)
    assert not all(r.ok for r in rows), "a stale activation went unnoticed"


def test_split_batch_refuses_uneven_splits(setup):
    _, batch, _, _ = setup
    with pytest.raises(ValueError, match="cannot split a batch of 4 into k=3"):
        G.split_batch(batch, 3)
