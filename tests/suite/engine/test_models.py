"""Model building on the CPU: random init, the pretrained path through save_pretrained, the weights modes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lora_suite.engine.models import CheckpointNotFound, build_model, build_random, build_tiny_llama, hf_config
from lora_suite.settings.config import ModelConfig
from tests.conftest import TINY_ARCH

CFG = ModelConfig(name="tiny-llama", checkpoint="nobody/tiny-llama-not-cached", architecture=TINY_ARCH)


def test_random_build_is_deterministic_and_llama_initialised():
    a = build_random(TINY_ARCH, torch.float32, "cpu", seed=3)
    b = build_random(TINY_ARCH, torch.float32, "cpu", seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    w = a.model.layers[0].self_attn.q_proj.weight
    assert abs(float(w.detach().std()) - 0.02) < 0.003 and torch.equal(a.model.norm.weight, torch.ones(64))
    assert sum(p.numel() for p in a.parameters()) == sum(
        p.numel() for p in __import__("transformers").LlamaForCausalLM(hf_config(TINY_ARCH)).parameters()
    )


def test_random_build_in_training_dtype_and_calls_on_layer():
    seen = []
    model = build_random(TINY_ARCH, torch.bfloat16, "cpu", on_layer=seen.append)
    assert len(seen) == TINY_ARCH.num_hidden_layers and seen[0] is model.model.layers[0]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_the_tiny_llama_takes_its_sizes_as_keywords():
    default = build_tiny_llama()
    assert all(
        torch.equal(p, q)
        for p, q in zip(default.parameters(), build_random(TINY_ARCH, torch.float32, "cpu").parameters())
    )
    wide = build_tiny_llama(torch.bfloat16, hidden_size=32, intermediate_size=64, vocab_size=64, num_hidden_layers=3)
    assert len(wide.model.layers) == 3 and wide.model.embed_tokens.weight.shape == (64, 32)
    assert wide.model.layers[0].mlp.up_proj.weight.shape == (64, 32) and wide.lm_head.weight.dtype == torch.bfloat16
    with pytest.raises(TypeError):
        build_tiny_llama(hidden=32)  # a size that is no LlamaArchitecture field


def test_tied_embeddings_stay_tied():
    model = build_random(dataclasses.replace(TINY_ARCH, tie_word_embeddings=True), torch.float32, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_pretrained_path_loads_a_saved_checkpoint(tmp_path):
    saved = build_random(TINY_ARCH, torch.float32, "cpu", seed=7)
    saved.save_pretrained(tmp_path / "ckpt")
    cfg = dataclasses.replace(CFG, local_path=str(tmp_path / "ckpt"))
    built = build_model(cfg, "pretrained", torch.float32, "cpu")
    assert built.weights == "pretrained" and str(tmp_path) in built.source
    ids = torch.randint(0, 300, (2, 16))
    assert torch.equal(built.model(input_ids=ids).logits, saved(input_ids=ids).logits)
    hooked = []
    build_model(cfg, "auto", torch.float32, "cpu", on_layer=hooked.append)  # the per-layer path through host memory
    assert len(hooked) == 2


def test_pretrained_without_checkpoint_gives_the_download_command():
    with pytest.raises(CheckpointNotFound, match=r"hf download nobody/tiny-llama-not-cached"):
        build_model(CFG, "pretrained", torch.float32, "cpu")


def test_auto_falls_back_to_random_and_says_so():
    built = build_model(CFG, "auto", torch.float32, "cpu")
    assert built.weights == "random" and "auto: no local checkpoint found" in built.source


def test_checkpoint_with_other_architecture_is_rejected(tmp_path):
    build_random(dataclasses.replace(TINY_ARCH, hidden_size=32), torch.float32, "cpu").save_pretrained(tmp_path / "c")
    with pytest.raises(ValueError, match=r"has hidden_size=32, but configs/models/tiny-llama.yaml says 64"):
        build_model(dataclasses.replace(CFG, local_path=str(tmp_path / "c")), "pretrained", torch.float32, "cpu")


def test_unknown_weights_mode():
    with pytest.raises(ValueError, match="weights='some' is not one of"):
        build_model(CFG, "some", torch.float32, "cpu")
