"""The fused LoRA MLP and QKV Functions (lora_core.ops.fused_mlp / fused_qkv) on the torch engine: the same GEMM
plan, buffers and in-place SwiGLU backward as the cupy engine, checked against the unfused layers composed by
autograd (float64: agreement to rounding), plus the casts, NF4 bases and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lora_core.layer import LoRALinear
from lora_core.nf4 import quantize_nf4
from lora_core.ops.fused_engine import TorchEngine, swiglu_backward_, swiglu_forward
from lora_core.ops.fused_mlp import MLPBases, lora_mlp
from lora_core.ops.fused_qkv import QKVBases, lora_qkv

K, INTER, R = 24, 40, 4


def _layer(out_f, in_f, dtype=torch.float64, adapter_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = LoRALinear(
        torch.randn(out_f, in_f, generator=g, dtype=dtype) / in_f**0.5,
        r=R,
        alpha=8,
        backend="torch",
        adapter_dtype=adapter_dtype,
    )
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.3, generator=g)
    return layer


def _mlp(dtype=torch.float64, adapter_dtype=None):
    return [
        _layer(INTER, K, dtype, adapter_dtype, 1),
        _layer(INTER, K, dtype, adapter_dtype, 2),
        _layer(K, INTER, dtype, adapter_dtype, 3),
    ]


def _nf4_copies(dense):
    """An NF4 LoRALinear per layer of ``dense``: its weight quantised, its adapters copied."""
    nf4 = []
    for m in dense:
        layer = LoRALinear(quantize_nf4(m.weight.detach()), r=R, alpha=8, backend="torch", quantize="nf4")
        layer.lora_A.data, layer.lora_B.data = m.lora_A.data.clone(), m.lora_B.data.clone()
        nf4.append(layer)
    return nf4


def _adapters(layers):
    return tuple(t for m in layers for t in (m.lora_A, m.lora_B))


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True)


@pytest.mark.parametrize("shape", [(7,), (2, 5), "noncontig"])
def test_fused_mlp_equals_the_unfused_layers_in_float64(shape):
    gate, up, down = _mlp()
    if shape == "noncontig":
        x = torch.randn(K, 6, dtype=torch.float64).t()  # (6, K), not contiguous
    else:
        x = torch.randn(*shape, K, dtype=torch.float64)
    x.requires_grad_(True)
    dy = torch.randn(*x.shape[:-1], K, dtype=torch.float64)
    params = [x, *_adapters([gate, up, down])]
    ref = down(F.silu(gate(x)) * up(x))
    ref_grads = _grads((ref * dy).sum(), params)
    bases = MLPBases(w_gu=torch.cat([gate.weight, up.weight]), w_d=down.weight)
    y = lora_mlp(x, bases, _adapters([gate, up, down]), gate.scale, down.scale, backend="torch")
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    for name, got, want in zip(["x", "Ag", "Bg", "Au", "Bu", "Ad", "Bd"], _grads((y * dy).sum(), params), ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11, msg=f"d{name}")


def test_fused_mlp_without_input_grad_still_trains_the_adapters():
    gate, up, down = _mlp()
    x = torch.randn(5, K, dtype=torch.float64)
    bases = MLPBases(w_gu=torch.cat([gate.weight, up.weight]), w_d=down.weight)
    y = lora_mlp(x, bases, _adapters([gate, up, down]), gate.scale, down.scale, backend="torch")
    ref = down(F.silu(gate(x)) * up(x))
    for got, want in zip(
        _grads(y.sum(), list(_adapters([gate, up, down]))), _grads(ref.sum(), list(_adapters([gate, up, down])))
    ):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)


def test_fused_mlp_refuses_a_second_backward_through_its_graph():
    gate, up, down = _mlp()
    x = torch.randn(3, K, dtype=torch.float64, requires_grad=True)
    bases = MLPBases(w_gu=torch.cat([gate.weight, up.weight]), w_d=down.weight)
    y = lora_mlp(x, bases, _adapters([gate, up, down]), gate.scale, down.scale, backend="torch").sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once per forward"):
        y.backward()


def test_fused_mlp_bf16_with_fp32_adapters_matches_the_unfused_path_to_bf16_rounding():
    gate, up, down = (m.to(torch.bfloat16) for m in _mlp())
    for m in (gate, up, down):
        m.lora_A.data, m.lora_B.data = m.lora_A.data.float(), m.lora_B.data.float()
    x = torch.randn(6, K, dtype=torch.bfloat16, requires_grad=True)
    bases = MLPBases(w_gu=torch.cat([gate.weight, up.weight]), w_d=down.weight)
    y = lora_mlp(x, bases, _adapters([gate, up, down]), gate.scale, down.scale, backend="torch")
    ref = down(F.silu(gate(x)) * up(x))
    torch.testing.assert_close(y, ref, rtol=3e-2, atol=3e-2)
    got = _grads(y.float().square().sum(), [x, gate.lora_A, down.lora_B])
    want = _grads(ref.float().square().sum(), [x, gate.lora_A, down.lora_B])
    assert [g.dtype for g in got] == [torch.bfloat16, torch.float32, torch.float32]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=5e-2, atol=5e-2 * w.abs().max().item())


def test_fused_mlp_on_nf4_bases_equals_the_unfused_nf4_layers():
    nf4 = _nf4_copies(_mlp(torch.float32))
    gate, up, down = nf4
    x = torch.randn(4, K, requires_grad=True)
    bases = MLPBases(nf4=(gate.nf4, up.nf4, down.nf4))
    y = lora_mlp(x, bases, _adapters(nf4), gate.scale, down.scale, backend="torch")
    ref = down(F.silu(gate(x)) * up(x))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    for g, w in zip(_grads(y.sum(), [x, *_adapters(nf4)]), _grads(ref.sum(), [x, *_adapters(nf4)])):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_fused_mlp_names_a_bad_shape_and_a_bad_dtype():
    gate, up, down = _mlp()
    bases = MLPBases(w_gu=torch.cat([gate.weight, up.weight]), w_d=down.weight)
    with pytest.raises(ValueError, match=r"x \(3, 5\) and bases"):
        lora_mlp(torch.randn(3, 5, dtype=torch.float64), bases, _adapters([gate, up, down]), 2.0, 2.0, backend="torch")
    with pytest.raises(ValueError, match="x has dtype torch.int64"):
        lora_mlp(torch.ones(3, K, dtype=torch.long), bases, _adapters([gate, up, down]), 2.0, 2.0, backend="torch")
    wrong = list(_adapters([gate, up, down]))
    wrong[1] = wrong[1][:, :2]
    with pytest.raises(ValueError, match=r"B_gate has shape \(40, 2\), expected \(40, 4\)"):
        lora_mlp(torch.randn(3, K, dtype=torch.float64), bases, tuple(wrong), 2.0, 2.0, backend="torch")


def _qkv(dtype=torch.float64):
    return [_layer(16, K, dtype, None, 4), _layer(8, K, dtype, None, 5), _layer(8, K, dtype, None, 6)]


@pytest.mark.parametrize("used", ["qkv", "qv"])
def test_fused_qkv_equals_the_unfused_layers_in_float64(used):
    q, k, v = _qkv()
    x = torch.randn(2, 3, K, dtype=torch.float64, requires_grad=True)
    params = [x, *_adapters([q, k, v])]
    ref = {"q": q(x), "k": k(x), "v": v(x)}
    bases = QKVBases((16, 8, 8), w_qkv=torch.cat([q.weight, k.weight, v.weight]))
    got = dict(zip("qkv", lora_qkv(x, bases, _adapters([q, k, v]), q.scale, backend="torch")))
    for p in "qkv":
        torch.testing.assert_close(got[p], ref[p], rtol=1e-12, atol=1e-12)
    # the attention transposes its parts; a part that takes no part in the loss has no gradient
    loss = lambda outs: sum((outs[p].transpose(0, 1) ** 2).sum() for p in used)  # noqa: E731
    for name, g, w in zip(
        ["x", "Aq", "Bq", "Ak", "Bk", "Av", "Bv"], _grads(loss(got), params), _grads(loss(ref), params)
    ):
        if w is None:  # k unused: its B gets no gradient from the unfused layer; the fused one gives zeros
            assert g is None or not g.any(), name
            continue
        torch.testing.assert_close(g, w, rtol=1e-11, atol=1e-11, msg=f"d{name}")


def test_fused_qkv_adds_the_q_k_v_biases_and_refuses_a_bad_one():
    q, k, v = _qkv()
    x = torch.randn(2, 3, K, dtype=torch.float64)
    bias = torch.randn(32, dtype=torch.float64)
    bases = QKVBases((16, 8, 8), w_qkv=torch.cat([q.weight, k.weight, v.weight]), bias=bias)
    got = lora_qkv(x, bases, _adapters([q, k, v]), q.scale, backend="torch")
    for out, layer, b in zip(got, (q, k, v), bias.split((16, 8, 8))):
        torch.testing.assert_close(out, layer(x) + b, rtol=1e-12, atol=1e-12)
    bad = QKVBases((16, 8, 8), w_qkv=bases.w_qkv, bias=bias[:31])
    with pytest.raises(ValueError, match=r"the q/k/v bias has shape \(31,\).*expected \(32,\)"):
        lora_qkv(x, bad, _adapters([q, k, v]), q.scale, backend="torch")


def test_fused_qkv_on_nf4_bases_equals_the_unfused_nf4_layers():
    nf4 = _nf4_copies(_qkv(torch.float32))
    x = torch.randn(5, K, requires_grad=True)
    outs = lora_qkv(
        x, QKVBases((16, 8, 8), nf4=tuple(m.nf4 for m in nf4)), _adapters(nf4), nf4[0].scale, backend="torch"
    )
    refs = [m(x) for m in nf4]
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    got = _grads(sum(o.sum() for o in outs), [x, *_adapters(nf4)])
    want = _grads(sum(r.sum() for r in refs), [x, *_adapters(nf4)])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_the_torch_engine_swiglu_steps_follow_their_formulas():
    g, u, d = (
        torch.randn(3, 5, dtype=torch.float64),
        torch.randn(3, 5, dtype=torch.float64),
        torch.randn(3, 5, dtype=torch.float64),
    )
    gu = torch.cat([g, u], dim=1)
    eng = TorchEngine()
    torch.testing.assert_close(swiglu_forward(eng, gu), F.silu(g) * u)
    gg = g.clone().requires_grad_(True)
    uu = u.clone().requires_grad_(True)
    dg, du = torch.autograd.grad((F.silu(gg) * uu * d).sum(), [gg, uu])
    dact = d.clone()
    swiglu_backward_(eng, dact, gu)
    torch.testing.assert_close(gu[:, :5], dg)
    torch.testing.assert_close(gu[:, 5:], du)
    torch.testing.assert_close(dact, F.silu(g) * u)


def test_the_torch_engine_gemm_writes_a_column_slice_and_accumulates():
    eng = TorchEngine()
    out = torch.zeros(4, 6, dtype=torch.float64)
    a, b = torch.randn(4, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    eng.gemm(out[:, 2:4], a, b, trans_b=True, alpha=2.0)
    torch.testing.assert_close(out[:, 2:4], 2 * a @ b.t())
    assert not out[:, :2].any() and not out[:, 4:].any()
    eng.gemm(out[:, 2:4], a, b, trans_b=True, beta=1.0)
    torch.testing.assert_close(out[:, 2:4], 3 * a @ b.t())


def test_a_fused_call_counts_each_layer_it_serves():
    from lora_core import backend_call_counts

    gate, up, down = _mlp()
    bases = MLPBases(w_gu=torch.cat([gate.weight, up.weight]), w_d=down.weight)
    before = backend_call_counts()["torch"]
    lora_mlp(torch.randn(2, K, dtype=torch.float64), bases, _adapters([gate, up, down]), 2.0, 2.0, backend="torch")
    q, k, v = _qkv()
    lora_qkv(
        torch.randn(2, K, dtype=torch.float64),
        QKVBases((16, 8, 8), w_qkv=torch.cat([q.weight, k.weight, v.weight])),
        _adapters([q, k, v]),
        2.0,
        backend="torch",
    )
    assert backend_call_counts()["torch"] - before == 6


def test_torch_compile_is_refused_by_name(monkeypatch):
    gate, up, down = _mlp()
    bases = MLPBases(w_gu=torch.cat([gate.weight, up.weight]), w_d=down.weight)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match="torch.compile cannot trace them; capture the training step"):
        lora_mlp(torch.randn(2, K, dtype=torch.float64), bases, _adapters([gate, up, down]), 2.0, 2.0, backend="torch")
