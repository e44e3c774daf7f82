"""lora_suite.implementations.liger_ops on the CPU, with a stand-in for Liger-Kernel's entry point (the real one
needs Triton and a GPU; the GPU runner runs it): what is asked of Liger, the names put back, the refusals."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from lora_core import inject_lora
from lora_suite.engine.models import build_random
from lora_suite.implementations.liger_ops import FusedOpsError, liger_ops
from tests.conftest import TINY_ARCH


@pytest.fixture
def fake_liger(monkeypatch):
    calls = []
    from transformers.models.llama import modeling_llama

    def apply(**kw):
        calls.append({k: v for k, v in kw.items() if k != "model"})
        modeling_llama.apply_rotary_pos_emb = "patched"  # what Liger does to module-level names

    pkg = types.ModuleType("liger_kernel")
    mod = types.ModuleType("liger_kernel.transformers")
    mod.apply_liger_kernel_to_llama = apply
    monkeypatch.setitem(sys.modules, "liger_kernel", pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", mod)
    return calls


def test_liger_swiglu_only_where_the_mlp_is_transformers_own_and_the_names_come_back(fake_liger):
    from transformers.models.llama import modeling_llama

    before = modeling_llama.apply_rotary_pos_emb
    plain = build_random(TINY_ARCH, torch.float32, "cpu")
    with liger_ops(plain):
        assert modeling_llama.apply_rotary_pos_emb == "patched"
    assert modeling_llama.apply_rotary_pos_emb is before
    fused = build_random(TINY_ARCH, torch.float32, "cpu")
    inject_lora(fused, "all-linear", r=2, backend="torch", fuse=("mlp",))
    with liger_ops(fused):
        pass
    assert [c["swiglu"] for c in fake_liger] == [True, False]
    assert all(c["fused_linear_cross_entropy"] and c["rms_norm"] and c["rope"] for c in fake_liger)


def test_liger_ops_refuse_a_model_that_is_not_a_llama_and_a_missing_package(fake_liger, monkeypatch):
    with pytest.raises(FusedOpsError, match="a LlamaForCausalLM is expected, got Linear"):
        with liger_ops(torch.nn.Linear(2, 2)):
            pass
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    with pytest.raises(FusedOpsError, match="--fused-ops liger needs Liger-Kernel, which does not import"):
        with liger_ops(build_random(TINY_ARCH, torch.float32, "cpu")):
            pass


def test_captured_steps_get_liger_without_its_fused_linear_cross_entropy(fake_liger):
    """Liger's fused linear cross-entropy stops a CUDA-graph capture (NOT_CAPTURABLE); its RMSNorm, RoPE and SwiGLU
    are kept for captured steps, so that a captured tier is not sent back to eager steps for one op."""
    with liger_ops(build_random(TINY_ARCH, torch.float32, "cpu"), captured=True):
        pass
    with liger_ops(build_random(TINY_ARCH, torch.float32, "cpu")):
        pass
    assert [c["fused_linear_cross_entropy"] for c in fake_liger] == [False, True]
    assert all(c["rms_norm"] and c["rope"] and c["swiglu"] for c in fake_liger)
