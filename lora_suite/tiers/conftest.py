"""Wiring of the tier tests: the ``tier`` fixture (a ``lora_suite.harness.tier.Tier``), the planted-defect rounds
and a tiny cupy Llama for the op-in-a-model checks."""

from __future__ import annotations

import time

import pytest

# torch and the harness are imported inside the fixtures: the controlling process of a run spread over workers loads
# this file too, and runs no test (harness/pytest_plugin.py keeps it free of torch)


def pytest_generate_tests(metafunc):
    """``plant_round``: the planted-defect self-tests that take it run ``--plant-repeats`` times (issue 18 asks
    for every plant caught in 5 runs of 5)."""
    if "plant_round" in metafunc.fixturenames:
        rounds = metafunc.config.getoption("plant_repeats")
        metafunc.parametrize("plant_round", range(1, rounds + 1), ids=[f"round{i}" for i in range(1, rounds + 1)])


@pytest.fixture
def tier(request, run_report, check, lora_impl):
    import torch

    from lora_suite.harness.tier import Tier

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: none found (torch.cuda.is_available() is False)")
    torch.cuda.init()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    t = Tier(request, run_report, check, lora_impl)
    yield t
    run_report.notes.append(f"{request.node.nodeid}: wall time {time.perf_counter() - start:.1f} s")


@pytest.fixture
def tiny_cupy_llama():
    """A factory: a small random Llama (2 layers, hidden 256, vocab 512) in bf16 on the GPU with cupy LoRA r8 on
    every linear (or ``targets``; ``quantize``, ``fuse`` as for ``inject_lora``) and B random (so that adapters
    matter): for the op-in-a-model checks that do not need a tier's model (capture, torch.compile)."""

    def build(seed: int = 0, *, targets="all-linear", quantize=None, fuse=()):
        import torch

        from lora_core.inject import inject_lora
        from lora_suite.engine.models import build_tiny_llama

        torch.manual_seed(seed)  # the adapters' initialisation below draws from the global generator
        sizes = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512}
        model = build_tiny_llama(torch.bfloat16, "cuda", seed=seed, **sizes).train()
        inject_lora(model, targets, 8, 16, backend="cupy", quantize=quantize, fuse=fuse)
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                torch.nn.init.normal_(p, std=0.02)
        return model

    return build
