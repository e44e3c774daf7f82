"""convergence tier: the cupy op under ``torch.compile(fullgraph=True, mode="reduce-overhead")`` trains like eager.

Inductor compiles everything around the LoRA op (norms, attention, softmax, the loss) into its own kernels and
cudagraph trees replay the step from the third run on; the op stays one ``lora_core::lora_linear`` node whose
CUDA implementation is the cupy path. Compiled and eager therefore differ by the bf16 rounding of the fused
ops, not bitwise. Bounds: loss relative 2^-6 (a few bf16 ulps, 2^-8 each, of accumulated difference) and each
adapter gradient 2^-4 of its tensor's max; a wrong op (a missing scale halves dA: relative 0.5; a wrong
transpose or stale input: O(1)) is far outside. About 40 s, almost all of it Inductor compiling.
"""

from __future__ import annotations

import pytest
import torch

import lora_core

pytestmark = [pytest.mark.gpu, pytest.mark.convergence, pytest.mark.needs_feature("lora_core_ops")]


def test_compiled_reduce_overhead_steps_match_eager(check, tiny_cupy_llama):
    model = tiny_cupy_llama()
    n_lora = sum(isinstance(m, lora_core.LoRALinear) for m in model.modules())
    ids = torch.randint(0, 512, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    eager = model(input_ids=ids, labels=ids).loss
    eager.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    calls_before = lora_core.backend_call_counts()["cupy"]
    runs = 4  # cudagraph trees warm up on the first run, record on the second and replay afterwards
    for _ in range(runs):
        model.zero_grad(set_to_none=True)
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
    torch.cuda.synchronize()
    calls = lora_core.backend_call_counts()["cupy"] - calls_before
    rel = abs(loss.item() - eager.item()) / abs(eager.item())
    grad_err = max(
        (p.grad.float() - eager_grads[n].float()).abs().max().item()
        / max(eager_grads[n].float().abs().max().item(), 1e-30)
        for n, p in model.named_parameters()
        if n in eager_grads
    )
    check(
        "compiled (reduce-overhead) loss vs eager, relative",
        round(rel, 6),
        "<=",
        2**-6,
        source="bf16 rounding of the fused ops (module docstring)",
    )
    check(
        "compiled adapter gradients vs eager, max error relative to each tensor's max",
        round(grad_err, 5),
        "<=",
        2**-4,
        source="bf16 rounding of the fused ops (module docstring)",
    )
    check("cupy op ran while compiling and recording", calls, ">", 0)
    check(
        f"cupy op calls over {runs} compiled steps: fewer than eager's {runs} x {n_lora} (replays call none)",
        calls,
        "<",
        runs * n_lora,
        source="the CUDA graph replayed the op",
    )


def test_llama_with_cupy_layers_traces_as_one_graph_with_one_op_node_per_layer(check, tiny_cupy_llama):
    """``torch.compile(fullgraph=True)`` of a Llama with injected cupy layers: no graph break, each LoRA layer one
    ``lora_core::lora_linear`` node. (Moved here from the quick tier, where it took 9.3 s of 31 in
    reports/20261122T104642Z-quick; most of that proved to be first-use start-up, which the quick tier's next
    test then paid, reports/20261122T110533Z-quick: the move saved ~1.6 s.)"""
    model = tiny_cupy_llama()
    n_lora = sum(isinstance(m, lora_core.LoRALinear) for m in model.modules())
    ids = torch.randint(0, 512, (2, 64), device="cuda")
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    traced = torch.compile(model, fullgraph=True, backend=record)(input_ids=ids, labels=ids).loss
    ops = (torch.ops.lora_core.lora_linear, torch.ops.lora_core.lora_linear.default)
    nodes = sum(1 for gm in graphs for node in gm.graph.nodes if node.target in ops)
    check("graphs traced by torch.compile(fullgraph=True) (a graph break is an error)", len(graphs), "==", 1)
    check("lora_core::lora_linear nodes in the graph, one per LoRA layer", nodes, "==", n_lora)
    eager = model(input_ids=ids, labels=ids).loss
    check("traced loss == eager loss (the same kernels, run by the graph)", traced.item(), "==", eager.item())
