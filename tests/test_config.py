"""Config loading: typed, strict, and errors that name the key and the file."""

from __future__ import annotations

import pytest

from lora_core.config import CONFIG_DIR, ConfigError, load_model_config, load_tier_config

TIERS = ("quick", "convergence", "memory", "extended", "full")


@pytest.mark.parametrize("tier", TIERS)
def test_shipped_tier_configs_load(tier):
    cfg = load_tier_config(CONFIG_DIR / f"{tier}.yaml")
    assert cfg.tier == tier and cfg.train.steps >= 10


def test_shipped_model_architectures_are_the_real_ones():
    smol, tiny, l7 = (load_model_config(n).architecture for n in ("smollm2-135m", "tinyllama-1.1b", "llama-2-7b"))
    assert (smol.hidden_size, smol.intermediate_size, smol.num_hidden_layers, smol.num_attention_heads,
            smol.num_key_value_heads, smol.vocab_size, smol.tie_word_embeddings, smol.rope_theta) == \
        (576, 1536, 30, 9, 3, 49152, True, 1e5)
    assert (tiny.hidden_size, tiny.intermediate_size, tiny.num_hidden_layers, tiny.num_attention_heads,
            tiny.num_key_value_heads, tiny.vocab_size, tiny.tie_word_embeddings) == (2048, 5632, 22, 32, 4, 32000, False)
    assert (l7.hidden_size, l7.intermediate_size, l7.num_hidden_layers, l7.num_attention_heads,
            l7.num_key_value_heads, l7.vocab_size) == (4096, 11008, 32, 32, 32, 32000)


def test_tier_sizes_follow_the_issue():
    assert load_tier_config("quick").train.steps == 10
    assert load_tier_config("convergence").train.steps == 100
    mem = load_tier_config("memory")
    assert (mem.train.steps, mem.data.batch_size, mem.model.name) == (50, 1, "tinyllama-1.1b")
    assert load_tier_config("extended").train.steps == 500
    assert load_tier_config("full").train.steps == 1000


def test_every_threshold_in_the_yaml_has_a_comment():
    """Each criteria value carries its provenance: an inline comment or a comment line right above it."""
    for tier in TIERS:
        lines = (CONFIG_DIR / f"{tier}.yaml").read_text().split("criteria:", 1)[1].splitlines()
        for i, line in enumerate(lines):
            if not line.strip() or line.strip().startswith("#"):
                continue
            above = next((prev.strip() for prev in reversed(lines[:i]) if prev.strip()), "")
            assert "#" in line or above.startswith("#"), f"{tier}.yaml criteria line {line.strip()!r} has no provenance"


def test_unknown_key_names_key_and_file(config_dir):
    path = config_dir / "tiny.yaml"
    path.write_text(path.read_text().replace("lr: 1.0e-2", "lr: 1.0e-2, lerning_rate: 3"))
    with pytest.raises(ConfigError, match=r"tiny.yaml\.train: unknown key\(s\) \['lerning_rate'\]"):
        load_tier_config(path)


def test_unknown_top_level_key(config_dir):
    path = config_dir / "tiny.yaml"
    path.write_text(path.read_text() + "colour: blue\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['colour'\]"):
        load_tier_config(path)


def test_malformed_yaml(config_dir):
    path = config_dir / "tiny.yaml"
    path.write_text("tier: [unclosed\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        load_tier_config(path)


def test_missing_model_lists_known_ones(config_dir):
    path = config_dir / "tiny.yaml"
    path.write_text(path.read_text().replace("model: tiny-llama", "model: gpt-5"))
    with pytest.raises(ConfigError, match=r"model config 'gpt-5' not found.*known models: \['tiny-llama'\]"):
        load_tier_config(path)


@pytest.mark.parametrize("old,new,message", [
    ("weights: random", "weights: maybe", r"weights: 'maybe' is not one of"),
    ("r: 4", "r: 0", r"lora.r: 0 must be >= 1"),
    ("r: 4", "r: four", r"\.lora\.r: expected int, got 'four'"),
    ("targets: [all-linear]", "targets: [qproj]", r"lora.targets: \['qproj'\]"),
    ("warmup_steps: 4", "warmup_steps: 40", r"warmup_steps: 40 must be in \[0, steps=40\)"),
    ("dtype: float32", "dtype: int8", r"dtype: 'int8' is not"),
])
def test_bad_values_are_named(config_dir, old, new, message):
    path = config_dir / "tiny.yaml"
    path.write_text(path.read_text().replace(old, new))
    with pytest.raises(ConfigError, match=message):
        load_tier_config(path)


def test_values_are_typed_and_frozen(tiny_cfg):
    assert tiny_cfg.lora.targets == ("all-linear",) and isinstance(tiny_cfg.train.lr, float)
    with pytest.raises(AttributeError):
        tiny_cfg.train.lr = 1.0
