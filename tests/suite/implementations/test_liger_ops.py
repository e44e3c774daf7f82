"""lora_suite.implementations.liger_ops on the CPU, with a stand-in for Liger-Kernel's entry point (the real one
needs Triton and a GPU; the GPU runner runs it): what is asked of Liger, the names put back, the refusals."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from lora_core import inject_lora
from lora_suite.engine.models import build_random
from lora_suite.implementations.liger_ops import FAMILIES, LIGER_FAMILIES, FusedOpsError, liger_ops
from tests.conftest import TINY_ARCH


@pytest.fixture
def fake_liger(monkeypatch):
    """Liger's entry points, one per family: each records its arguments (and its own name, as "entry") and patches
    its family's module-level RoPE name, as Liger does."""
    import importlib

    calls = []
    pkg = types.ModuleType("liger_kernel")
    mod = types.ModuleType("liger_kernel.transformers")
    for fam in FAMILIES.values():

        def apply(_fam=fam, **kw):
            calls.append({"entry": _fam.entry, **{k: v for k, v in kw.items() if k != "model"}})
            importlib.import_module(_fam.module).apply_rotary_pos_emb = "patched"

        setattr(mod, fam.entry, apply)
    monkeypatch.setitem(sys.modules, "liger_kernel", pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", mod)
    return calls


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_qwen2_and_gemma2_get_their_own_entry_point_and_mlp_switch(fake_liger, family):
    import importlib

    model = build_random(dataclasses.replace(TINY_ARCH, family=family), torch.float32, "cpu")
    fam = FAMILIES[type(model).__name__]
    module = importlib.import_module(fam.module)
    before = module.apply_rotary_pos_emb
    with liger_ops(model):
        assert module.apply_rotary_pos_emb == "patched"
    assert module.apply_rotary_pos_emb is before
    fused = build_random(dataclasses.replace(TINY_ARCH, family=family), torch.float32, "cpu")
    inject_lora(fused, "all-linear", r=2, backend="torch", fuse=("mlp",))
    with liger_ops(fused, captured=True):
        pass
    assert [c["entry"] for c in fake_liger] == [fam.entry] * 2
    assert [c[fam.mlp_switch] for c in fake_liger] == [True, False]
    assert [c["fused_linear_cross_entropy"] for c in fake_liger] == [True, False]


def test_every_family_of_the_model_configs_that_liger_covers_is_in_the_table():
    classes = {
        type(build_random(dataclasses.replace(TINY_ARCH, family=f), torch.float32, "cpu")).__name__
        for f in LIGER_FAMILIES
    }
    assert classes == set(FAMILIES)


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


def test_liger_ops_refuse_a_model_of_another_family_and_a_missing_package(fake_liger, monkeypatch):
    with pytest.raises(FusedOpsError, match=r"a model of \['Gemma2ForCausalLM', .*\] is expected, got Linear"):
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
