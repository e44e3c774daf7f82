"""convergence tier: checkpointed QLoRA training reuses the bases its recompute dequantised, and trains bitwise alike.

Under activation checkpointing a layer's forward runs again inside the backward; lora_core keeps the NF4 bases that
recompute dequantised for the layer's backward (``lora_core.ops.recompute``) instead of dequantising them a third
time. The dequantisation is deterministic, so the same step with and without reuse must give the same losses and
adapters bit for bit, eager and captured in a CUDA graph; with reuse, every base kept is taken by its backward
(none dropped, none held after the step) and the steps launch fewer dequantisations. It sits here, not in the quick
tier, because torch.utils.checkpoint imports torch._dynamo on its first call (test_captured_checkpointing.py).
"""

from __future__ import annotations

import contextlib
from typing import TypedDict

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.convergence, pytest.mark.needs_feature("lora_core_ops")]

DEV = "cuda"
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
CASES = {  # (LoRA targets, fused parts): the full tier's layout (frozen NF4 MLP), and every fused NF4 path
    "qkvo-frozen-nf4-mlp": (QKVO, ()),
    "qkvo-fused-qkv": (QKVO, ("qkv",)),
    "all-linear-fused-mlp-qkv": ("all-linear", ("mlp", "qkv")),
}
STEPS, GRAPH_WARMUP = 5, 2


class _Run(TypedDict):
    """One training run: its losses and adapters after the steps, and what the steps changed of the reuse counters
    (``lora_core.ops.recompute.reuse_counts``; ``held`` as it is after) and of the dequantisation launches."""

    losses: list[float]
    adapters: dict[str, torch.Tensor]
    kept: int
    taken: int
    dropped: int
    held: int
    launches: int


def _dequant_launches() -> int:
    from lora_core.ops import kernel_variants

    return sum(n.count for v, n in kernel_variants.reached().items() if v.kernel == "nf4_dequantize")


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpointed_nf4_training_reuses_the_recomputed_bases_bitwise_alike(tiny_cupy_llama, case):
    from lora_core.inject import adapter_parameters
    from lora_core.ops import recompute
    from lora_suite.engine.trainer import train
    from lora_suite.settings.config import TrainSettings

    targets, fuse = CASES[case]
    gen = torch.Generator(device="cpu").manual_seed(3)
    data = [torch.randint(0, 512, (2, 64), generator=gen) for _ in range(STEPS)]

    def batches(i):
        ids = data[i].to(DEV)
        return {"input_ids": ids, "labels": ids}

    runs: dict[str, _Run] = {}
    for name, reuse, captured in (("eager, no reuse", False, False), ("eager", True, False), ("captured", True, True)):
        model = tiny_cupy_llama(targets=targets, quantize="nf4", fuse=fuse)
        s = TrainSettings(
            steps=STEPS,
            lr=5e-3,
            warmup_steps=1,
            gradient_checkpointing=True,
            cuda_graph=captured,
            graph_warmup_steps=GRAPH_WARMUP,
            log_every=STEPS,
        )
        counts, launches = recompute.reuse_counts(), _dequant_launches()
        with contextlib.nullcontext() if reuse else recompute.reuse_disabled():
            result = train(model, batches, s)
        torch.cuda.synchronize()
        after = recompute.reuse_counts()
        runs[name] = {
            "losses": [r.loss for r in result.records],
            "adapters": {n: p.detach().clone() for n, p in adapter_parameters(model).items()},
            "kept": after["kept"] - counts["kept"],
            "taken": after["taken"] - counts["taken"],
            "dropped": after["dropped"] - counts["dropped"],
            "held": after["held"],
            "launches": _dequant_launches() - launches,
        }
        del model, result
    ref = runs["eager, no reuse"]
    assert ref["kept"] == 0 and ref["taken"] == 0, f"reuse disabled, yet {ref}"
    for name in ("eager", "captured"):
        run = runs[name]
        assert run["losses"] == ref["losses"], f"{name}: losses {run['losses']} vs without reuse {ref['losses']}"
        differing = [n for n in ref["adapters"] if not torch.equal(ref["adapters"][n], run["adapters"][n])]
        assert not differing, f"{name}: adapters differ from the run without reuse: {differing[:5]}"
        assert run["kept"] > 0, f"{name}: no base was kept by a recompute ({run})"
        assert run["taken"] == run["kept"] and run["dropped"] == 0 and run["held"] == 0, f"{name}: {run}"
    eager = runs["eager"]
    assert eager["launches"] < ref["launches"], (
        f"dequantisation launches over {STEPS} eager steps: {eager['launches']} with reuse, {ref['launches']} without"
    )
