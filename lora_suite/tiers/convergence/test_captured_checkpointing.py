"""convergence tier: captured training with gradient checkpointing replays bitwise equal to eager.

Moved here from the quick tier (issue 28: quick <= 30 s on a fresh GPU machine). ``torch.utils.checkpoint`` wraps
``checkpoint`` in ``torch._disable_dynamo``, which imports torch._dynamo on its first call; in the quick tier that
first call cost 15.9 s on a fresh H100 and 11.5 s warm (this test's grad_accum=2 case, after it: 1.4 s; wall-time
breakdowns of runs 20261124T192427Z-quick and …192532Z-quick at 243680f). This tier imports the compiler stack
anyway (test_compiled_steps.py). The quick tier keeps the captured layer test (test_capture_and_compile.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.convergence, pytest.mark.needs_feature("lora_core_ops")]

DEV = "cuda"


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_captured_training_with_checkpointing_equals_eager_bitwise(tiny_cupy_llama, grad_accum):
    """``train.cuda_graph`` with ``gradient_checkpointing``: the recomputation runs inside the captured backward.

    Same seed, same batches, eager vs captured (2 eager warm-up steps, then replays): every step's loss and
    the final adapters must be bitwise equal, since replay runs the kernels eager ran on the same data. A
    replay that read capture time's lr, batch or adapters instead would differ from step 3 on.
    """
    from lora_core.inject import adapter_parameters
    from lora_suite.engine.trainer import train
    from lora_suite.settings.config import TrainSettings

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
