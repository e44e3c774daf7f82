"""The cupy op inside CUDA graphs and torch.compile: replay equals eager, the registered op passes opcheck.

Why these matter: a training step captured in a CUDA graph (``train.cuda_graph``) or compiled with
``mode="reduce-overhead"`` replays the kernels recorded at capture time; an op that could not be captured
(CuPy's cuBLAS wrappers refuse stream capture) or whose replay read stale buffers would either fail or train
on wrong numbers. Replay runs the same kernels on the same data, so it must be *bitwise* equal to eager.
"""

from __future__ import annotations

import pytest
import torch

import lora_core
from lora_core.ops.registered import lora_linear_op
from lora_suite.parity import random_case

pytestmark = [pytest.mark.gpu, pytest.mark.quick, pytest.mark.needs_feature("lora_core_ops")]

DEV = "cuda"
F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("dtype,adapter_dtype", [(F32, F32), (BF16, F32), (BF16, BF16)])
def test_registered_op_passes_opcheck_on_cuda(dtype, adapter_dtype):
    x, w, a, b, _ = random_case((3, 40), 96, 80, 8, dtype, adapter_dtype, DEV)
    before = lora_core.backend_call_counts()["cupy"]
    torch.library.opcheck(torch.ops.lora_core.lora_linear.default, (x, w.detach(), a, b, 1.5))
    assert lora_core.backend_call_counts()["cupy"] > before, "the CUDA implementation (cupy path) did not run"


def test_registered_op_on_cuda_equals_the_autograd_function_bitwise():
    x, w, a, b, dy = random_case((512,), 1024, 768, 16, BF16, F32, DEV)
    results = []
    for fn in (lambda: lora_core.lora_linear(x, w, a, b, 2.0, backend="cupy"), lambda: lora_linear_op(x, w, a, b, 2.0)):
        for t in (x, a, b):
            t.grad = None
        y = fn()
        y.backward(dy)
        results.append((y.detach(), x.grad, a.grad, b.grad))
    for name, u, v in zip(("y", "dx", "dA", "dB"), *results):
        assert torch.equal(u, v), f"{name}: op and Function differ by {(u.float() - v.float()).abs().max()}"


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


def _tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lora_core.inject import inject_lora
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).to(DEV, BF16)
    inject_lora(model, ["all-linear"], 8, 16, backend="cupy")
    for n, p in model.named_parameters():
        if n.endswith("lora_B"):
            torch.nn.init.normal_(p, std=0.02)
    return model


def test_llama_with_cupy_layers_compiles_fullgraph_and_reduce_overhead_matches_eager(check):
    model = _tiny_llama()
    n_lora = sum(isinstance(m, lora_core.LoRALinear) for m in model.modules())
    ids = torch.randint(0, 512, (2, 64), device=DEV)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    loss_traced = torch.compile(model, fullgraph=True, backend=record)(input_ids=ids, labels=ids).loss
    ops = (torch.ops.lora_core.lora_linear, torch.ops.lora_core.lora_linear.default)
    nodes = sum(1 for gm in graphs for node in gm.graph.nodes if node.target in ops)
    check("graphs traced by torch.compile(fullgraph=True) (a graph break is an error)", len(graphs), "==", 1)
    check("lora_core::lora_linear nodes in the graph, one per LoRA layer", nodes, "==", n_lora)

    eager = model(input_ids=ids, labels=ids).loss
    eager.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    calls_before = lora_core.backend_call_counts()["cupy"]
    for _ in range(4):  # cudagraph trees record on the second run and replay afterwards
        model.zero_grad(set_to_none=True)
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
    torch.cuda.synchronize()
    calls = lora_core.backend_call_counts()["cupy"] - calls_before
    rel = abs(loss.item() - eager.item()) / abs(eager.item())
    grad_err = max((p.grad.float() - eager_grads[n].float()).abs().max().item() /
                   max(eager_grads[n].float().abs().max().item(), 1e-30)
                   for n, p in model.named_parameters() if n in eager_grads)
    # Inductor fuses and reorders the ops around the LoRA op (norms, attention, softmax): results differ from
    # eager by bf16 rounding of those, not bitwise. 2^-6 relative (a few bf16 ulps of accumulated difference)
    # is far below what a wrong op gives (a missing scale or transpose moves the loss and grads by O(1)).
    check("compiled (reduce-overhead) loss vs eager, relative", round(rel, 6), "<=", 2 ** -6, source="bf16 rounding")
    check("compiled adapter gradients vs eager, max relative to each tensor's max", round(grad_err, 5), "<=",
          2 ** -4, source="bf16 rounding of the fused ops around the LoRA op")
    check("cupy op calls over 4 compiled steps (fewer than 4 x forward+backward: CUDA-graph replays call none)",
          calls, "<", 4 * n_lora, source="cudagraph trees replay from the third run")
    check("cupy op ran while compiling and recording", calls, ">", 0)
