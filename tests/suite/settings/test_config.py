"""Config loading: the shipped configs load, typed and frozen. The values it refuses, with errors that name the key
and the file, are the bad-input battery's: tests/suite/settings/test_bad_settings.py."""

from __future__ import annotations

import pytest

from lora_suite.settings.config import CONFIG_DIR
from lora_suite.settings.loader import load_model_config, load_tier_config
from lora_suite.settings.registry import registry

TIERS = tuple(registry())  # every tier of the registry: a YAML in configs/ with a suite: section


@pytest.mark.parametrize("tier", TIERS)
def test_shipped_tier_configs_load(tier):
    cfg = load_tier_config(CONFIG_DIR / f"{tier}.yaml")
    assert cfg.tier == tier and cfg.train.steps >= 10


def test_shipped_model_architectures_are_the_real_ones():
    smol, tiny, l7 = (load_model_config(n).architecture for n in ("smollm2-135m", "tinyllama-1.1b", "llama-2-7b"))
    assert (
        smol.hidden_size,
        smol.intermediate_size,
        smol.num_hidden_layers,
        smol.num_attention_heads,
        smol.num_key_value_heads,
        smol.vocab_size,
        smol.tie_word_embeddings,
        smol.rope_theta,
    ) == (576, 1536, 30, 9, 3, 49152, True, 1e5)
    assert (
        tiny.hidden_size,
        tiny.intermediate_size,
        tiny.num_hidden_layers,
        tiny.num_attention_heads,
        tiny.num_key_value_heads,
        tiny.vocab_size,
        tiny.tie_word_embeddings,
    ) == (2048, 5632, 22, 32, 4, 32000, False)
    assert (
        l7.hidden_size,
        l7.intermediate_size,
        l7.num_hidden_layers,
        l7.num_attention_heads,
        l7.num_key_value_heads,
        l7.vocab_size,
    ) == (4096, 11008, 32, 32, 32, 32000)


def test_tier_sizes_follow_the_issue():
    assert load_tier_config("quick").train.steps == 10
    assert load_tier_config("convergence").train.steps == 100
    mem = load_tier_config("memory")
    assert (mem.train.steps, mem.data.batch_size, mem.model.name) == (50, 1, "tinyllama-1.1b")
    assert load_tier_config("extended").train.steps == 500
    assert load_tier_config("full").train.steps == 1000


# Found when the tiers came from the registry instead of a copied list (multigpu was not in it); strict: once the
# comment is written this fails until the mark goes
@pytest.mark.parametrize("tier", TIERS)
def test_every_threshold_in_the_yaml_has_a_comment(tier):
    """Each criteria value carries its provenance: an inline comment or a comment line right above it."""
    lines = (CONFIG_DIR / f"{tier}.yaml").read_text().split("criteria:", 1)[1].splitlines()
    for i, line in enumerate(lines):
        if not line.strip() or line.strip().startswith("#"):
            continue
        above = next((prev.strip() for prev in reversed(lines[:i]) if prev.strip()), "")
        assert "#" in line or above.startswith("#"), f"{tier}.yaml criteria line {line.strip()!r} has no provenance"


def test_values_are_typed_and_frozen(tiny_cfg):
    assert tiny_cfg.lora.targets == ("all-linear",) and isinstance(tiny_cfg.train.lr, float)
    with pytest.raises(AttributeError):
        tiny_cfg.train.lr = 1.0


def test_float_written_without_a_dot_is_accepted(config_dir):
    """PyYAML (YAML 1.1) reads `1e-3` as a string; it used to fail with "expected float, got '1e-3'"."""
    path = config_dir / "tiny.yaml"
    path.write_text(path.read_text().replace("lr: 1.0e-2", "lr: 1e-3"))
    assert load_tier_config(path).train.lr == 1e-3
