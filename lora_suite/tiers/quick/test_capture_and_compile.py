"""The cupy op inside CUDA graphs: replay equals eager, bitwise.

(The registered op's checks, ``torch.library.opcheck`` and its bitwise equality with the autograd Function, and
the check that ``torch.compile`` traces a whole Llama as one graph sit with the compiled training steps in the
convergence tier: the first call of the registered op imports torch's compiler stack, 3.2-5.5 s of the quick
tier on an H200, reports/20261124T063239Z-quick and …063714Z-quick. So does captured training with gradient
checkpointing, tiers/convergence/test_captured_checkpointing.py: torch.utils.checkpoint imports torch._dynamo on
its first call, 11.5 s warm and 15.9 s on a fresh H100 in this tier, issue 28.)

Why these matter: a training step captured in a CUDA graph (``train.cuda_graph``) or compiled with
``mode="reduce-overhead"`` replays the kernels recorded at capture time; an op that could not be captured
(CuPy's cuBLAS wrappers refuse stream capture) or whose replay read stale buffers would either fail or train
on wrong numbers. Replay runs the same kernels on the same data, so it must be *bitwise* equal to eager.
"""

from __future__ import annotations

import pytest
import torch

import lora_core

pytestmark = [pytest.mark.gpu, pytest.mark.quick, pytest.mark.needs_feature("lora_core_ops")]

DEV = "cuda"
F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_captured_forward_backward_replays_bitwise_equal_to_eager(quantize):
    torch.manual_seed(0)
    base = torch.nn.Linear(1024, 768, bias=True, device=DEV, dtype=BF16)
    layer = lora_core.LoRALinear.from_linear(base, r=16, alpha=32, backend="cupy", quantize=quantize)
    torch.nn.init.normal_(layer.lora_B, std=0.05)
    static_x = torch.randn(4, 128, 1024, device=DEV, dtype=BF16, requires_grad=True)
    static_dy = torch.randn(4, 128, 768, device=DEV, dtype=BF16)

    def step():
        layer.zero_grad(set_to_none=False)
        static_x.grad = None
        y = layer(static_x)
        y.backward(static_dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside capture (allocations, kernel loading), as torch's docs require
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    layer.lora_A.grad.zero_()
    layer.lora_B.grad.zero_()
    with torch.cuda.graph(graph):
        static_x.grad = torch.zeros_like(static_x)
        y_static = layer(static_x)
        y_static.backward(static_dy)
    # New inputs and new adapter values after capture: replay must read the buffers afresh, not capture time's.
    x_new, dy_new = torch.randn_like(static_x), torch.randn_like(static_dy)
    with torch.no_grad():
        layer.lora_A.add_(0.01 * torch.randn_like(layer.lora_A))
        layer.lora_B.add_(0.01 * torch.randn_like(layer.lora_B))
    static_x.data.copy_(x_new)
    static_dy.copy_(dy_new)
    for t in (layer.lora_A.grad, layer.lora_B.grad, static_x.grad):
        t.zero_()
    graph.replay()
    got = (y_static.detach().clone(), static_x.grad.clone(), layer.lora_A.grad.clone(), layer.lora_B.grad.clone())
    x_e = x_new.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)  # fresh grads for the eager run (the graph keeps writing to the old ones)
    y_e = layer(x_e)
    y_e.backward(dy_new)
    expected = (y_e.detach(), x_e.grad, layer.lora_A.grad, layer.lora_B.grad)
    for name, u, v in zip(("y", "dx", "dA", "dB"), got, expected):
        assert torch.equal(u, v), f"{name} replayed differs from eager by {(u.float() - v.float()).abs().max()}"
