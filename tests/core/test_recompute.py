"""lora_core.ops.recompute: a checkpointed recompute's dequantised NF4 base reused by the backward that follows it.

On the CPU the fused MLP and QKV Functions run their torch engine, the same code that decides what to keep as on
the cupy engine; the dequantisations are counted by wrapping the module's ``dequantize_nf4``. The cupy layer's own
case (CupyLoRALinear, CupyNF4Linear) is the quick tier's ``test_nf4_recompute_reuse``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lora_core.layer import LoRALinear
from lora_core.nf4 import quantize_nf4
from lora_core.ops import fused_mlp, fused_qkv, recompute
from lora_core.ops.fused_mlp import MLPBases, lora_mlp
from lora_core.ops.fused_qkv import QKVBases, lora_qkv

K, INTER, R = 64, 128, 4


class _Probe(torch.autograd.Function):
    """x², recording ``in_recompute()`` at each forward (it saves x, so a non-reentrant checkpoint recomputes it)."""

    seen: list[bool] = []

    @staticmethod
    def forward(ctx, x):
        _Probe.seen.append(recompute.in_recompute())
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return 2 * x * dy


@pytest.mark.parametrize("reentrant", [False, True])
def test_in_recompute_is_true_only_in_the_forward_a_checkpoint_replays_during_backward(reentrant):
    _Probe.seen = []
    x = torch.randn(3, requires_grad=True)
    _Probe.apply(x).sum().backward()  # a plain forward and backward
    checkpoint(lambda t: _Probe.apply(t) * 2, x, use_reentrant=reentrant).sum().backward()
    assert _Probe.seen == [False, False, True]
    with recompute.reuse_disabled():
        checkpoint(lambda t: _Probe.apply(t) * 2, x, use_reentrant=reentrant).sum().backward()
    assert _Probe.seen[3:] == [False, False]
    assert recompute.in_recompute() is False


def _nf4_layers(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    layers = []
    for out_f, in_f in sizes:
        w = torch.randn(out_f, in_f, generator=g) / in_f**0.5
        layer = LoRALinear(quantize_nf4(w), r=R, alpha=8, backend="torch", quantize="nf4")
        with torch.no_grad():
            layer.lora_B.normal_(0, 0.3, generator=g)
        layers.append(layer)
    return layers


def _adapters(layers):
    return tuple(t for m in layers for t in (m.lora_A, m.lora_B))


def _counting(monkeypatch, module):
    calls = []
    real = module.dequantize_nf4

    def counted(q, *args, **kwargs):
        calls.append(tuple(q.shape))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(module, "dequantize_nf4", counted)
    return calls


def _backward(y, params):
    """The gradients of Σy² by ``backward()`` (reentrant checkpointing refuses ``autograd.grad``)."""
    for p in params:
        p.grad = None
    y.square().sum().backward()
    return [p.grad.clone() for p in params]


def _mlp_step(layers, x, ckpt, reentrant=False):
    gate, up, down = layers

    def f(t):  # the bases' wrappers made anew at each call, as lora_core.fuse does (layer.nf4 is a property)
        bases = MLPBases(nf4=(gate.nf4, up.nf4, down.nf4))
        return lora_mlp(t, bases, _adapters(layers), gate.scale, down.scale, backend="torch")

    y = checkpoint(f, x, use_reentrant=reentrant) if ckpt else f(x)
    return _backward(y, [p for p in (x, *_adapters(layers)) if p.requires_grad])


def _qkv_step(layers, x, ckpt, reentrant=False):
    def f(t):
        bases = QKVBases(tuple(m.out_features for m in layers), nf4=tuple(m.nf4 for m in layers))
        return torch.cat(lora_qkv(t, bases, _adapters(layers), layers[0].scale, backend="torch"), dim=-1)

    y = checkpoint(f, x, use_reentrant=reentrant) if ckpt else f(x)
    return _backward(y, [p for p in (x, *_adapters(layers)) if p.requires_grad])


CASES = {
    "mlp": (fused_mlp, _mlp_step, [(INTER, K), (INTER, K), (K, INTER)], 2),  # [W_g; W_u] and W_d kept
    "qkv": (fused_qkv, _qkv_step, [(K, K), (K // 2, K), (K // 2, K)], 1),  # [W_q; W_k; W_v] kept
}


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("what", sorted(CASES))
def test_a_checkpointed_step_dequantises_each_base_twice_and_its_gradients_do_not_change(what, reentrant, monkeypatch):
    module, step, sizes, kept_per_step = CASES[what]
    layers = _nf4_layers(sizes, seed=7)
    calls = _counting(monkeypatch, module)
    x = torch.randn(2, 5, K, requires_grad=True)

    plain = step(layers, x, ckpt=False)
    assert len(calls) == 6, "a plain step: each of the 3 bases once forward, once backward"

    calls.clear()
    before = recompute.reuse_counts()
    with recompute.reuse_disabled():
        replayed = step(layers, x, ckpt=True, reentrant=reentrant)
    assert len(calls) == 9, "checkpointed without reuse: forward, recompute and backward each dequantise"
    assert recompute.reuse_counts() == before

    calls.clear()
    reused = step(layers, x, ckpt=True, reentrant=reentrant)
    assert len(calls) == 6, f"checkpointed with reuse: the backward dequantised again ({calls})"
    after = recompute.reuse_counts()
    assert after["kept"] - before["kept"] == kept_per_step
    assert after["taken"] - before["taken"] == kept_per_step
    assert after["dropped"] == before["dropped"] and after["held"] == 0

    for a, b, c in zip(plain, replayed, reused):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_a_plain_step_keeps_nothing(monkeypatch):
    layers = _nf4_layers(CASES["mlp"][2], seed=3)
    before = recompute.reuse_counts()
    _mlp_step(layers, torch.randn(4, K, requires_grad=True), ckpt=False)
    assert recompute.reuse_counts() == before


def test_a_base_whose_backward_does_not_read_it_is_not_kept(monkeypatch):
    """x needs no gradient (a first layer over frozen embeddings): [W_g; W_u] serves only dx, so it is not kept;
    W_d still serves dact, which the adapters' gradients need."""
    layers = _nf4_layers(CASES["mlp"][2], seed=5)
    calls = _counting(monkeypatch, fused_mlp)
    before = recompute.reuse_counts()
    _mlp_step(layers, torch.randn(4, K), ckpt=True)
    after = recompute.reuse_counts()
    assert (after["kept"] - before["kept"], after["taken"] - before["taken"]) == (1, 1)
    assert len(calls) == 6  # gate, up, down forward; again in the recompute; nothing in the backward


def test_a_kept_base_the_backward_never_takes_is_dropped_when_the_backward_pass_ends():
    """A region whose QKV output takes no part in the loss: the recompute runs the QKV forward (keeping W_qkv),
    autograd never reaches its backward, and the entry is dropped when the backward pass ends, not held."""
    layers = _nf4_layers(CASES["qkv"][2], seed=9)
    bases = QKVBases(tuple(m.out_features for m in layers), nf4=tuple(m.nf4 for m in layers))
    x = torch.randn(3, K, requires_grad=True)

    def f(t):
        q, _, _ = lora_qkv(t, bases, _adapters(layers), layers[0].scale, backend="torch")
        return q, t * t  # the square's saved t is the last tensor saved: the recompute runs the QKV first

    before = recompute.reuse_counts()
    _, sq = checkpoint(f, x, use_reentrant=False)
    (dx,) = torch.autograd.grad(sq.sum(), [x])
    after = recompute.reuse_counts()
    torch.testing.assert_close(dx, 2 * x)
    assert after["kept"] - before["kept"] == 1 and after["taken"] == before["taken"]
    assert after["dropped"] - before["dropped"] == 1 and after["held"] == 0


def test_the_table_holds_at_most_max_held_bases(monkeypatch):
    """Bases kept and never taken (here: forwards run inside a backward pass that takes none) are capped, the
    oldest dropped first, and whatever is left is dropped when the pass ends."""
    monkeypatch.setattr(recompute, "MAX_HELD", 3)
    weights = [quantize_nf4(torch.randn(8, 64)) for _ in range(5)]
    held = []

    class KeepAll(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, dy):
            for q in weights:  # as a recompute would: each base kept for a backward that never comes
                recompute.keep(q, "w", torch.zeros(8, 64))
            held.append(recompute.reuse_counts()["held"])
            return dy * 2

    before = recompute.reuse_counts()
    KeepAll.apply(torch.ones(2, requires_grad=True)).sum().backward()
    after = recompute.reuse_counts()
    assert held == [3]
    assert after["kept"] - before["kept"] == 5 and after["dropped"] - before["dropped"] == 5 and after["held"] == 0
    assert recompute.take(weights[-1], "w", torch.float32) is None


def test_a_whole_checkpointed_nf4_llama_takes_every_base_its_recompute_kept():
    """transformers' own checkpointing of a tiny Llama (non-reentrant, torch's early stop), fused MLP and QKV on
    NF4 bases: every kept base is taken by its layer's backward, none dropped, and the adapters' gradients equal
    those of the same step without reuse, bit for bit."""
    from lora_core import inject_lora
    from lora_core.inject import adapter_parameters
    from lora_suite.engine.models import build_random
    from tests.conftest import TINY_ARCH

    model = build_random(TINY_ARCH, torch.float32, "cpu", seed=3)
    inject_lora(model, "all-linear", r=4, alpha=8, backend="torch", quantize="nf4", fuse=("mlp", "qkv"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    params = adapter_parameters(model)
    with torch.no_grad():
        for p in params.values():
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(5))
    ids = torch.randint(0, TINY_ARCH.vocab_size, (2, 8), generator=torch.Generator().manual_seed(4))

    def grads():
        return torch.autograd.grad(model(input_ids=ids, labels=ids).loss, list(params.values()))

    with recompute.reuse_disabled():
        without = grads()
    before = recompute.reuse_counts()
    with_reuse = grads()
    after = recompute.reuse_counts()
    kept, taken = after["kept"] - before["kept"], after["taken"] - before["taken"]
    layers = TINY_ARCH.num_hidden_layers
    # per layer [W_q; W_k; W_v], [W_g; W_u] and W_d; the first layer's q/k/v only where transformers makes the
    # checkpointed layer's input require grad (it does, as of 5.x: its dx is then computed)
    assert kept >= 3 * layers - 1 and taken == kept
    assert after["dropped"] == before["dropped"] and after["held"] == 0
    for a, b in zip(without, with_reuse):
        assert torch.equal(a, b)
