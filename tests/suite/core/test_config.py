"""Config loading: typed, strict, and errors that name the key and the file."""

from __future__ import annotations

import pytest

from lora_suite.core.config import CONFIG_DIR, ConfigError
from lora_suite.core.loader import load_model_config, load_tier_config

TIERS = ("quick", "convergence", "memory", "extended", "full")


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


@pytest.mark.parametrize(
    "old,new,message",
    [
        ("weights: random", "weights: maybe", r"weights: 'maybe' is not one of"),
        ("r: 4", "r: 0", r"lora.r: 0 is out of range; expected 1 <= r <="),
        ("r: 4", "r: four", r"\.lora\.r: expected int, got 'four'"),
        ("targets: [all-linear]", "targets: [qproj]", r"lora.targets: \['qproj'\]"),
        (
            "warmup_steps: 4",
            "warmup_steps: 40",
            r"warmup_steps: 40 is out of range; expected 0 <= warmup_steps < steps=40",
        ),
        ("dtype: float32", "dtype: int8", r"dtype: 'int8' is not"),
    ],
)
def test_bad_values_are_named(config_dir, old, new, message):
    path = config_dir / "tiny.yaml"
    path.write_text(path.read_text().replace(old, new))
    with pytest.raises(ConfigError, match=message):
        load_tier_config(path)


def test_values_are_typed_and_frozen(tiny_cfg):
    assert tiny_cfg.lora.targets == ("all-linear",) and isinstance(tiny_cfg.train.lr, float)
    with pytest.raises(AttributeError):
        tiny_cfg.train.lr = 1.0


# Values that used to load and then silently ruin training, or fail late inside torch/transformers (issue 8):
# each must be refused at load time with the key, the value and the allowed range in the message.
BAD_VALUES = [
    ("train", "max_grad_norm: -1", "train.max_grad_norm: -1.0 is out of range; expected null .* or finite, > 0"),
    ("train", "max_grad_norm: 0", r"train.max_grad_norm: 0.0 is out of range"),
    ("train", "min_lr_ratio: -1", r"train.min_lr_ratio: -1.0 is out of range; expected 0 <= x <= 1"),
    ("train", "min_lr_ratio: 5", r"train.min_lr_ratio: 5.0 is out of range"),
    ("train", "weight_decay: -1", r"train.weight_decay: -1.0 is out of range; expected finite, >= 0"),
    ("train", "lr: .nan", r"train.lr: nan is out of range; expected finite, > 0"),
    ("train", "lr: .inf", r"train.lr: inf is out of range"),
    ("lora", "alpha: 0", r"lora.alpha: 0.0 is out of range; expected finite, > 0"),
    ("lora", "r: 33", r"lora.r: 33 is out of range; expected 1 <= r <= 32 \(min\(in, out\) of k_proj"),
    (
        "data",
        "seq_len: 5000",
        r"data.seq_len: 5000 is out of range; expected 2 <= seq_len <= max_position_embeddings=4096",
    ),
]


@pytest.mark.parametrize("section,line,message", BAD_VALUES, ids=[b[1] for b in BAD_VALUES])
def test_out_of_range_values_are_refused_at_load_time(config_dir, section, line, message):
    path = config_dir / "tiny.yaml"
    text = path.read_text()
    key = line.split(":")[0]
    head, body = text.split(f"{section}: {{", 1)
    body = (
        ", ".join(p for p in body.split("}", 1)[0].split(", ") if not p.startswith(key + ":"))
        + "}"
        + body.split("}", 1)[1]
    )
    path.write_text(f"{head}{section}: {{{line}, {body}")
    with pytest.raises(ConfigError, match=message):
        load_tier_config(path)


@pytest.mark.parametrize(
    "change,message",
    [
        ("hidden_size: 64", "hidden_size: 0"),
        ("num_attention_heads: 4", "num_attention_heads: 5"),
        ("num_key_value_heads: 2", "num_key_value_heads: 3"),
    ],
    ids=["hidden-zero", "heads-do-not-divide-hidden", "kv-heads-do-not-divide-heads"],
)
def test_architectures_that_cannot_exist_are_refused(config_dir, change, message):
    model = config_dir / "models" / "tiny-llama.yaml"
    model.write_text(model.read_text().replace(change, message))
    with pytest.raises(ConfigError, match=r"architecture\.(hidden_size|num_attention_heads): \d+ is out of range"):
        load_tier_config(config_dir / "tiny.yaml")


def test_float_written_without_a_dot_is_accepted(config_dir):
    """PyYAML (YAML 1.1) reads `1e-3` as a string; it used to fail with "expected float, got '1e-3'"."""
    path = config_dir / "tiny.yaml"
    path.write_text(path.read_text().replace("lr: 1.0e-2", "lr: 1e-3"))
    assert load_tier_config(path).train.lr == 1e-3


def test_text_in_a_float_field_says_it_is_not_a_number(config_dir):
    path = config_dir / "tiny.yaml"
    path.write_text(path.read_text().replace("lr: 1.0e-2", "lr: fast"))
    with pytest.raises(ConfigError, match=r"train.lr: expected a number, got 'fast' \(not a number literal\)"):
        load_tier_config(path)


def test_two_loss_windows_must_fit_the_run(config_dir):
    path = config_dir / "tiny.yaml"
    path.write_text(path.read_text().replace("loss_window: 5", "loss_window: 30"))
    with pytest.raises(ConfigError, match=r"criteria.loss_window: 30 is out of range; expected >= 1, and two windows"):
        load_tier_config(path)


def test_the_old_backend_key_names_its_replacement(config_dir):
    path = config_dir / "tiny.yaml"
    path.write_text(path.read_text().replace("implementation: torch", "backend: torch"))
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['backend'\].*'backend' is now 'implementation'"):
        load_tier_config(path)


@pytest.mark.parametrize("value", ["'my lora'", "'pkg.mod:'", "''", "3"])
def test_an_implementation_that_is_no_name_is_refused(config_dir, value):
    path = config_dir / "tiny.yaml"
    path.write_text(path.read_text().replace("implementation: torch", f"implementation: {value}"))
    with pytest.raises(ConfigError, match=r"implementation"):
        load_tier_config(path)
