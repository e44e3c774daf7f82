"""The model families ``lora_suite.engine.models`` builds (``LlamaArchitecture.family``, issue 55): a Qwen2-shaped model
(q, k, v with a non-zero bias) random-initialised offline like the Llama, its model YAML at SmolLM2's widths for the
convergence tier, a family the loader refuses, and the tiny tier trained on a Qwen2-shaped model on the CPU (what the
convergence tier's Qwen2 case does at SmolLM2's size on a GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lora_suite.engine.models import TINY_LLAMA, build_random
from lora_suite.engine.prepare import prepare
from lora_suite.engine.trainer import train
from lora_suite.measure.criteria import loss_drop
from lora_suite.settings.config import LlamaArchitecture, SettingsError
from lora_suite.settings.loader import load_model_config

QWEN2 = dataclasses.replace(TINY_LLAMA, family="qwen2")


def test_a_qwen2_family_builds_qwen2_with_non_zero_q_k_v_biases_and_llama_stays_bias_free():
    model, again = build_random(QWEN2, torch.float32, "cpu", seed=1), build_random(QWEN2, torch.float32, "cpu", seed=1)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    biases = {n: p for n, p in model.named_parameters() if n.endswith(".bias")}
    assert {n.rsplit(".", 2)[-2] for n in biases} == {"q_proj", "k_proj", "v_proj"}
    assert all(bool((b != 0).all()) for b in biases.values()), "a zero bias would hide a stack that drops it"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    llama = build_random(TINY_LLAMA, torch.float32, "cpu", seed=1)
    assert type(llama).__name__ == "LlamaForCausalLM" and not any(
        n.endswith(".bias") for n, _ in llama.named_parameters()
    )


def test_the_qwen2_model_yaml_is_smollm2_widths_with_the_qwen2_family():
    qwen2, smollm2 = load_model_config("qwen2-smollm2-shape"), load_model_config("smollm2-135m")
    assert qwen2.architecture.family == "qwen2" and smollm2.architecture.family == "llama"
    assert dataclasses.replace(qwen2.architecture, family="llama") == smollm2.architecture


def test_a_family_the_suite_cannot_build_is_refused_by_name():
    with pytest.raises(
        SettingsError, match=r"LlamaArchitecture\.family: .*'gpt2'.*\['llama', 'qwen2', 'gemma2', 'qwen3_moe'\]"
    ):
        LlamaArchitecture(**{**dataclasses.asdict(TINY_LLAMA), "family": "gpt2"})


def test_the_tiny_tier_trains_a_qwen2_shaped_model_and_keeps_its_biases(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, model=dataclasses.replace(tiny_cfg.model, architecture=QWEN2))
    prepared = prepare(cfg, "cpu", implementation="torch")
    biases = {n: p.detach().clone() for n, p in prepared.model.named_parameters() if n.endswith(".bias")}
    assert len(biases) == 3 * QWEN2.num_hidden_layers
    result = train(prepared.model, prepared.batches, cfg.train, adapters=prepared.adapters)
    assert loss_drop(result.losses, cfg.criteria.loss_window) >= cfg.criteria.loss_drop_min  # the tiny tier's bar
    after = dict(prepared.model.named_parameters())
    assert all(torch.equal(after[n], b) for n, b in biases.items())


@pytest.mark.parametrize("name,family,cls", [("gemma-2-2b", "gemma2", "Gemma2"), ("qwen2.5-0.5b", "qwen2", "Qwen2")])
def test_the_fused_tables_qwen2_and_gemma_presets_build_their_family_at_their_shapes(name, family, cls):
    """The fused table's Qwen2- and Gemma-shaped cases (issue 57), one layer and a small vocabulary on the CPU: their
    family's classes, every projection at the memory estimator's shapes (Gemma 2's heads are 256 wide, not hidden /
    heads), Gemma's (1 + w) norms at w = 0 and its tanh-GELU gate, logits that depend on the input."""
    from lora_suite.measure.memory import linear_shapes

    arch = load_model_config(name).architecture
    assert arch.family == family
    small = dataclasses.replace(arch, num_hidden_layers=1, vocab_size=512)
    model = build_random(small, torch.float32, "cpu")
    assert type(model).__name__ == f"{cls}ForCausalLM"
    layer = model.model.layers[0]
    got = {n.rsplit(".", 1)[-1]: (m.in_features, m.out_features) for n, m in layer.named_modules() if "proj" in n}
    assert got == linear_shapes(small)
    if family == "gemma2":
        assert small.head_dim == 256 and got["q_proj"] == (2304, 2048)
        assert (
            float(model.model.norm.weight.abs().max()) == 0.0 and model.config.hidden_activation == "gelu_pytorch_tanh"
        )
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss)
    # every buffer set (Gemma's √hidden embedding scale, left empty, made every logit 0 and the loss exactly ln V)
    assert float(out.logits.std()) > 1e-3, "constant logits: the model computes nothing of its input"
    if family == "gemma2":
        assert float(model.model.embed_tokens.embed_scale) == pytest.approx(2304**0.5)


def test_a_head_width_below_one_is_refused_by_name():
    with pytest.raises(SettingsError, match="attention_head_dim"):
        dataclasses.replace(TINY_LLAMA, attention_head_dim=0)


def test_buffers_an_on_layer_hook_adds_are_kept_and_every_family_builds_with_an_nf4_hook():
    """The buffer rule covers what ``to_empty`` materialised, not what the per-layer hook adds after it: lora_core's
    injection with an NF4 base registers ``weight_packed`` buffers there (the full and memory tiers build so; a rule
    applied to the whole model once refused them on an H100, run 20261127T233902Z-full-cupy_fused)."""
    from lora_core.inject import inject_lora

    for family in ("llama", "qwen2", "gemma2"):
        arch = dataclasses.replace(TINY_LLAMA, family=family)
        model = build_random(
            arch,
            torch.float32,
            "cpu",
            on_layer=lambda layer: inject_lora(layer, "all-linear", 4, backend="torch", quantize="nf4"),
        )
        packed = [n for n, _ in model.named_buffers() if n.endswith("weight_packed")]
        assert len(packed) == 7 * arch.num_hidden_layers, (family, packed[:3])
