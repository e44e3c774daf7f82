"""CPU tests of the LoRA op: the torch reference backend against float64 autograd, and every input error."""

from __future__ import annotations

import pytest
import torch

from lora_core import lora_linear, lora_linear_torch

SHAPES = [  # (leading dims, in, out, r)
    ((1,), 1, 1, 1),
    ((3,), 7, 5, 2),
    ((2, 3), 11, 4, 3),
    ((5,), 4, 9, 4),
    ((2, 1, 3), 6, 6, 1),
    ((), 5, 3, 2),
]


def _inputs(lead, k, o, r, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, dtype=dtype, generator=g, requires_grad=True)
    w = torch.randn(o, k, dtype=dtype, generator=g)
    a = torch.randn(r, k, dtype=dtype, generator=g, requires_grad=True)
    b = torch.randn(o, r, dtype=dtype, generator=g, requires_grad=True)  # non-zero so dA is exercised
    return x, w, a, b


@pytest.mark.parametrize("lead,k,o,r", SHAPES)
def test_torch_backend_passes_gradcheck(lead, k, o, r):
    x, w, a, b = _inputs(lead, k, o, r)
    assert torch.autograd.gradcheck(lambda x, a, b: lora_linear(x, w, a, b, 1.7, backend="torch"), (x, a, b))


@pytest.mark.parametrize("lead,k,o,r", SHAPES)
def test_torch_backend_matches_explicit_formula(lead, k, o, r):
    x, w, a, b = _inputs(lead, k, o, r)
    s = 0.5
    y = lora_linear(x, w, a, b, s, backend="torch")
    expected = x @ w.T + s * (x @ a.T) @ b.T
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    assert y.shape == (*lead, o)


def test_weight_never_gets_a_gradient_and_must_be_frozen():
    x, w, a, b = _inputs((3,), 4, 5, 2)
    lora_linear(x, w, a, b, 1.0, backend="torch").sum().backward()
    assert w.grad is None
    with pytest.raises(ValueError, match="weight requires grad"):
        lora_linear(x, w.requires_grad_(), a, b, 1.0, backend="torch")


def test_x_without_grad_still_gives_adapter_grads():
    x, w, a, b = _inputs((3,), 4, 5, 2)
    x = x.detach()
    lora_linear(x, w, a, b, 1.0, backend="torch").sum().backward()
    assert a.grad is not None and b.grad is not None and x.grad is None


def test_fp32_adapters_under_bf16_activations_get_fp32_grads():
    x, w, a, b = _inputs((3,), 8, 4, 2, dtype=torch.float32)
    x16 = x.detach().to(torch.bfloat16).requires_grad_()
    y = lora_linear(x16, w.to(torch.bfloat16), a, b, 2.0, backend="torch")
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float32 and x16.grad.dtype == torch.bfloat16


def test_autocast_on_cpu_runs_in_autocast_dtype():
    x, w, a, b = _inputs((3,), 8, 4, 2, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lora_linear(x, w, a, b, 2.0, backend="torch")
    assert y.dtype == torch.bfloat16


def test_scale_zero_is_exactly_the_base_layer():
    x, w, a, b = _inputs((4,), 6, 3, 2)
    torch.testing.assert_close(lora_linear(x, w, a, b, 0.0, backend="torch"), x @ w.T, rtol=0, atol=0)


def test_nan_propagates_like_torch():
    x, w, a, b = _inputs((4,), 6, 3, 2)
    x = x.detach().clone()
    x[1, 2] = float("nan")
    y = lora_linear(x, w, a, b, 1.0, backend="torch")
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2, 3]]).all()


def test_reference_function_is_the_dispatch_target():
    x, w, a, b = _inputs((3,), 4, 5, 2)
    torch.testing.assert_close(lora_linear(x, w, a, b, 0.3, backend="torch"), lora_linear_torch(x, w, a, b, 0.3))


BAD_INPUTS = [
    # (what to change, message fragment)
    (lambda x, w, a, b: (x[..., :3], w, a, b), r"x has shape \(3, 3\), expected \(\.\.\., 4\)"),
    (lambda x, w, a, b: (x, w[0], a, b), r"weight has shape \(4,\), expected 2-D"),
    (lambda x, w, a, b: (x, w, a[:, :3], b), r"lora_a has shape \(2, 3\), expected \(r, 4\)"),
    (lambda x, w, a, b: (x, w, a, b[:, :1]), r"lora_b has shape \(5, 1\), expected \(5, 2\)"),
    (lambda x, w, a, b: (x, w, a, b.T), r"lora_b has shape \(2, 5\), expected \(5, 2\)"),
    (lambda x, w, a, b: (x.int(), w, a, b), r"x has dtype torch.int32"),
    (lambda x, w, a, b: (x.float(), w, a, b), r"weight has dtype torch.float64 but x has torch.float32"),
    (lambda x, w, a, b: (x, w, a.float(), b), r"lora_a has dtype torch.float32 but lora_b has torch.float64"),
    (
        lambda x, w, a, b: (x.half(), w.half(), a.bfloat16(), b.bfloat16()),
        r"adapters have dtype torch.bfloat16, expected torch.float16 or torch.float32",
    ),
    (lambda x, w, a, b: (x, w.to("meta"), a, b), r"all tensors must be on one device.*weight on meta"),
    (lambda x, w, a, b: ("x", w, a, b), r"x must be a torch.Tensor, got str"),
]


@pytest.mark.parametrize("mutate,message", BAD_INPUTS)
def test_bad_input_raises_naming_the_value(mutate, message):
    x, w, a, b = _inputs((3,), 4, 5, 2)
    with pytest.raises(ValueError, match=message):
        lora_linear(*mutate(x.detach(), w, a.detach(), b.detach()), 1.0, backend="torch")


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "2", torch.tensor(2.0)])
def test_bad_scale_raises(scale):
    x, w, a, b = _inputs((3,), 4, 5, 2)
    with pytest.raises(ValueError, match="scale=.* must be a finite Python number"):
        lora_linear(x, w, a, b, scale, backend="torch")


def test_unknown_backend_raises():
    x, w, a, b = _inputs((3,), 4, 5, 2)
    with pytest.raises(ValueError, match=r"backend='triton' is not known"):
        lora_linear(x, w, a, b, 1.0, backend="triton")


def _route_as_cupy(monkeypatch):
    """Make lora_core believe it runs the cupy backend, on the CPU. Eager cupy calls would need a GPU, but while
    torch.compile traces, the cupy backend is the registered op, whose CPU implementation is torch ops: so the
    routing and the absence of graph breaks are testable here (the CUDA implementation runs in tiers/quick)."""
    import lora_core.layer as layer_mod
    import lora_core.ops.lora_linear as op_mod

    monkeypatch.setattr(op_mod, "resolve_backend", lambda backend, device: "cupy")
    monkeypatch.setattr(layer_mod, "resolve_backend", lambda backend, device: "cupy")


def _op_nodes(graphs):
    ops = (torch.ops.lora_core.lora_linear, torch.ops.lora_core.lora_linear.default)
    return sum(1 for gm in graphs for node in gm.graph.nodes if node.target in ops)


def test_a_llama_with_injected_cupy_layers_compiles_to_one_graph_of_registered_ops(monkeypatch):
    from lora_core.inject import inject_lora
    from lora_suite.engine.models import build_tiny_llama

    _route_as_cupy(monkeypatch)
    torch.manual_seed(0)
    model = build_tiny_llama(vocab_size=64, hidden_size=32, intermediate_size=64).train()
    inject_lora(model, ["q_proj", "v_proj"], 4, 8, backend="cupy")
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = torch.randint(0, 64, (2, 8))
    loss = torch.compile(model, fullgraph=True, backend=record)(input_ids=ids, labels=ids).loss  # a break: error
    loss.backward()
    assert len(graphs) == 1 and _op_nodes(graphs) == 4  # 2 layers x (q, v), each one node of the traced graph
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_an_nf4_base_under_torch_compile_is_refused_with_the_reason(monkeypatch):
    from lora_core.nf4 import quantize_nf4

    _route_as_cupy(monkeypatch)
    x, w, a, b = _inputs((2,), 64, 8, 2, dtype=torch.float32)
    q = quantize_nf4(w)

    def f(x, a, b):
        return lora_linear(x, q, a, b, 1.0, backend="cupy")

    with pytest.raises(Exception, match="NF4 base weight under torch.compile is not supported"):
        torch.compile(f, fullgraph=True, backend="eager")(x, a, b)
