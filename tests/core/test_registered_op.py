"""The registered LoRA op (lora_core/ops/registered.py) on the CPU: PyTorch's own op checks, the fake
implementations' shapes and dtypes, gradients against float64 autograd, and tracing by torch.compile."""

from __future__ import annotations

import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lora_core.ops.lora_linear import lora_linear_torch
from lora_core.ops.registered import lora_linear_op

GradcheckError = sys.modules["torch.autograd.gradcheck"].GradcheckError  # the module is shadowed by the function


def _case(lead=(2, 3), k=16, o=12, r=4, dtype=torch.float32, adapter_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g).to(dtype).requires_grad_()
    w = torch.randn(o, k, generator=g).to(dtype)
    a = torch.randn(r, k, generator=g).to(adapter_dtype or dtype).requires_grad_()
    b = torch.randn(o, r, generator=g).to(adapter_dtype or dtype).requires_grad_()
    return x, w, a, b


@pytest.mark.parametrize(
    "dtype,adapter_dtype", [(torch.float32, None), (torch.float64, None), (torch.bfloat16, torch.float32)]
)
def test_opcheck_passes(dtype, adapter_dtype):
    x, w, a, b = _case(dtype=dtype, adapter_dtype=adapter_dtype)
    torch.library.opcheck(torch.ops.lora_core.lora_linear.default, (x, w, a, b, 0.7))


def test_fake_implementations_give_shapes_and_dtypes_without_data():
    with FakeTensorMode():
        x = torch.empty(2, 5, 64, dtype=torch.bfloat16)
        w = torch.empty(48, 64, dtype=torch.bfloat16)
        a, b = torch.empty(8, 64), torch.empty(48, 8)  # fp32 adapters under bf16 activations
        y, h = torch.ops.lora_core.lora_linear(x, w, a, b, 2.0)
        dx, da, db = torch.ops.lora_core.lora_linear_backward(y, x, w, a, b, h, 2.0, True)
        no_dx, _, _ = torch.ops.lora_core.lora_linear_backward(y, x, w, a, b, h, 2.0, False)
    assert (tuple(y.shape), y.dtype) == ((2, 5, 48), torch.bfloat16)
    assert (tuple(h.shape), h.dtype) == ((2, 5, 8), torch.bfloat16)
    assert (tuple(dx.shape), dx.dtype) == ((2, 5, 64), torch.bfloat16)
    assert (tuple(da.shape), da.dtype, tuple(db.shape), db.dtype) == ((8, 64), torch.float32, (48, 8), torch.float32)
    assert no_dx.numel() == 0


def test_gradients_match_float64_autograd_of_the_formula():
    x, w, a, b = _case(dtype=torch.float64)
    torch.autograd.gradcheck(lambda x, a, b: lora_linear_op(x, w, a, b, 1.3), (x, a, b))
    y = lora_linear_op(x, w, a, b, 1.3)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, a, b), dy)
    ref = torch.autograd.grad(lora_linear_torch(x, w, a, b, 1.3), (x, a, b), dy)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_without_grad_for_x_only_adapters_get_gradients():
    x, w, a, b = _case()
    x = x.detach()
    lora_linear_op(x, w, a, b, 1.0).sum().backward()
    assert x.grad is None and a.grad is not None and b.grad is not None


def test_a_planted_missing_scale_in_da_is_caught_by_gradcheck(monkeypatch):
    """The check above can fail: dA without its scale (a classic LoRA backward bug) does not pass gradcheck."""
    import lora_core.ops.registered as R

    x, w, a, b = _case(dtype=torch.float64)

    def bad_backward(ctx, dy, _dh):
        dx, _, da, db, _ = R._backward(ctx, dy, _dh)
        return dx, None, da / ctx.scale, db, None

    R.lora_linear_forward.register_autograd(bad_backward, setup_context=R._setup_context)
    try:
        with pytest.raises(GradcheckError):
            torch.autograd.gradcheck(lambda x, a, b: lora_linear_op(x, w, a, b, 1.3), (x, a, b))
    finally:
        R.lora_linear_forward.register_autograd(R._backward, setup_context=R._setup_context)
    torch.autograd.gradcheck(lambda x, a, b: lora_linear_op(x, w, a, b, 1.3), (x, a, b))


def test_torch_compile_traces_a_model_of_these_layers_without_a_graph_break():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            _, self.w, a, b = _case(lead=(1,), k=16, o=16, r=4)
            self.a, self.b = torch.nn.Parameter(a.detach()), torch.nn.Parameter(b.detach())

        def forward(self, x):
            for _ in range(2):
                x = torch.relu(lora_linear_op(x, self.w, self.a, self.b, 0.5))
            return x

    model = Block()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a break is an error
    x = torch.randn(3, 16)
    torch.testing.assert_close(compiled(x), model(x))
    compiled(x).sum().backward()
    assert model.a.grad is not None


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda x, w, a, b: (x, w.requires_grad_(), a, b), "must not require grad"),
        (lambda x, w, a, b: (x, w, a[:, :8], b), r"lora_a \(4, 8\) \(expected \(r, 16\)\)"),
        (lambda x, w, a, b: (x, w, a, b[:6]), r"lora_b \(6, 4\) \(expected \(12, r\)\)"),
    ],
)
def test_bad_inputs_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        lora_linear_op(*change(*_case()), 1.0)
