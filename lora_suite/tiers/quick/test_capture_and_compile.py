"""The cupy op inside CUDA graphs: replay equals eager, bitwise.

(The registered op's checks, ``torch.library.opcheck`` and its bitwise equality with the autograd Function, and
the check that ``torch.compile`` traces a whole Llama as one graph sit with the compiled training steps in the
convergence tier: the first call of the registered op imports torch's compiler stack, 3.2-5.5 s of the quick
tier on an H200, reports/20261124T063239Z-quick and …063714Z-quick.)

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


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_captured_training_with_checkpointing_equals_eager_bitwise(tiny_cupy_llama, grad_accum):
    """``train.cuda_graph`` with ``gradient_checkpointing``: the recomputation runs inside the captured backward.

    Same seed, same batches, eager vs captured (2 eager warm-up steps, then replays): every step's loss and
    the final adapters must be bitwise equal, since replay runs the kernels eager ran on the same data. A
    replay that read capture time's lr, batch or adapters instead would differ from step 3 on.
    """
    from lora_core.inject import adapter_parameters
    from lora_suite.core.config import TrainSettings
    from lora_suite.engine.trainer import train

    gen = torch.Generator(device="cpu").manual_seed(1)
    data = [torch.randint(0, 512, (2, 64), generator=gen) for _ in range(8 * grad_accum)]

    def batches(i):
        ids = data[i].to(DEV)
        return {"input_ids": ids, "labels": ids}

    runs = {}
    for captured in (False, True):
        model = tiny_cupy_llama()
        s = TrainSettings(
            steps=8,
            lr=5e-3,
            warmup_steps=2,
            schedule="cosine",
            grad_accum=grad_accum,
            gradient_checkpointing=True,
            cuda_graph=captured,
            graph_warmup_steps=2,
            log_every=8,
        )
        result = train(model, batches, s)
        assert [r.captured for r in result.records] == [captured and i >= 2 for i in range(8)]
        runs[captured] = (
            [r.loss for r in result.records],
            {n: p.detach().clone() for n, p in adapter_parameters(model).items()},
        )
    (eager_losses, eager_adapters), (graph_losses, graph_adapters) = runs[False], runs[True]
    assert graph_losses == eager_losses, f"captured {graph_losses} vs eager {eager_losses}"
    differing = [n for n in eager_adapters if not torch.equal(eager_adapters[n], graph_adapters[n])]
    assert not differing, f"adapters differ after 8 steps: {differing[:5]}"
