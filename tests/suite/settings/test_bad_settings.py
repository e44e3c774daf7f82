"""The bad-input battery (issue 20), the settings: tier and model YAML fed broken, missing, mismatched and hostile
values, and files that are no YAML mapping at all (``lora_suite.settings.loader`` and ``settings_rules``).

Each case asserts a clear error that names the bad value (or the key) and what was expected, raised when the config
is loaded. The battery's other entry points sit with the code they attack: ``tests/**/test_bad_*.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from lora_suite.settings.config import CONFIG_DIR, ConfigError
from lora_suite.settings.loader import load_model_config, load_tier_config
from lora_suite.settings.settings_rules import RULES

DEL = "<deleted>"
NAN, INF = float("nan"), float("inf")
# The thresholds that are off (null) or a positive number, from the rules themselves (settings_rules.RULES)
POSITIVE_CRITERIA = [rule.field for rule in RULES["Criteria"] if rule.expected == "null or finite, > 0"]

# ------------------------------------------------------------------ tier YAML values
# (base tier, key path, bad value, what the message must hold besides the key). A base is a shipped tier
# (configs/<tier>.yaml) or "tiny": the CPU tests' own tier and its 2-layer model (tests/conftest.py).
TIER_CASES = [
    ("quick", "dtype", "float8", "not one of ['bfloat16', 'float16', 'float32']"),
    ("quick", "dtype", 3, "expected str, got 3"),
    ("tiny", "dtype", "int8", "dtype: 'int8' is not"),
    ("quick", "weights", "maybe", "'maybe' is not one of ['auto', 'pretrained', 'random']"),
    ("tiny", "weights", "maybe", "weights: 'maybe' is not one of"),
    ("quick", "model", "gpt-5", "model config 'gpt-5' not found"),
    ("tiny", "model", "gpt-5", "known models: ['tiny-llama']"),
    ("quick", "model", 7, "expected the name of a file"),
    ("quick", "model", DEL, "expected the name of a file"),
    (
        "quick",
        "implementation",
        "no such impl!",
        "implementation: LoRA implementation 'no such impl!': expected a name",
    ),
    ("tiny", "implementation", "my lora", "implementation: LoRA implementation 'my lora': expected a name"),
    (
        "tiny",
        "implementation",
        "pkg.mod:",
        "implementation: LoRA implementation 'pkg.mod:': expected package.module:factory",
    ),
    ("tiny", "implementation", "", "implementation: LoRA implementation '': expected a name"),
    ("tiny", "implementation", 3, "implementation: expected str, got 3"),
    ("tiny", "backend", "torch", "('backend' is now 'implementation')"),
    ("quick", "lora.r", 0, "0 is out of range; expected 1 <= r"),
    ("tiny", "lora.r", 0, "lora.r: 0 is out of range; expected 1 <= r <="),
    ("quick", "lora.r", -4, "-4 is out of range"),
    ("quick", "lora.r", "8", "expected int, got '8'"),
    ("tiny", "lora.r", "four", ".lora.r: expected int, got 'four'"),
    ("quick", "lora.r", 2.5, "expected int, got 2.5"),
    ("quick", "lora.r", 4096, "4096 is out of range; expected 1 <= r <= 192"),
    ("tiny", "lora.r", 33, "lora.r: 33 is out of range; expected 1 <= r <= 32 (min(in, out) of k_proj"),
    ("quick", "lora.alpha", -1, "-1.0 is out of range; expected finite, > 0"),
    ("quick", "lora.alpha", 0, "0.0 is out of range"),
    ("tiny", "lora.alpha", 0, "lora.alpha: 0.0 is out of range; expected finite, > 0"),
    ("quick", "lora.alpha", "big", "expected a number, got 'big'"),
    ("quick", "lora.targets", ["qq_proj"], "['qq_proj'] not among"),
    ("tiny", "lora.targets", ["qproj"], "lora.targets: ['qproj']"),
    ("quick", "lora.targets", [], "[] not among"),
    ("quick", "lora.targets", [1, 2], "lora.targets[0]: expected str, got 1"),
    ("quick", "lora.quantize", "nf8", "'nf8' is not one of [None, 'nf4']"),
    ("quick", "lora.adapter_dtype", "int8", "'int8' is not one of"),
    ("quick", "lora.use_rslora", "yes", "expected bool, got 'yes'"),
    ("quick", "lora.dropout", 0.1, "unknown key(s) ['dropout']"),
    ("quick", "lora", None, "expected a mapping, got NoneType"),
    ("quick", "lora", [1, 2], "expected a mapping, got list"),
    ("quick", "data.batch_size", 0, "0 is out of range; expected >= 1"),
    ("quick", "data.batch_size", -1, "-1 is out of range"),
    ("quick", "data.batch_size", "8", "expected int, got '8'"),
    ("quick", "data.seq_len", 0, "0 is out of range; expected 2 <= seq_len"),
    ("quick", "data.seq_len", 10**9, "1000000000 is out of range"),
    ("tiny", "data.seq_len", 5000, "5000 is out of range; expected 2 <= seq_len <= max_position_embeddings=4096"),
    ("quick", "data.source", "web", "'web' is not one of ['embedded', 'jsonl']"),
    ("quick", "data.source", "jsonl", "source 'jsonl' needs the path"),
    ("quick", "data.pool", -1, "-1 is out of range; expected >= 0"),
    ("quick", "data.shuffle", True, "unknown key(s) ['shuffle']"),
    ("quick", "train.steps", 0, "0 is out of range; expected >= 1"),
    ("quick", "train.steps", -5, "-5 is out of range"),
    ("quick", "train.steps", True, "expected int, got True"),
    ("quick", "train.steps", 1.5, "expected int, got 1.5"),
    ("quick", "train.lr", -1e-3, "-0.001 is out of range; expected finite, > 0"),
    ("quick", "train.lr", 0, "0.0 is out of range"),
    ("quick", "train.lr", "fast", "expected a number, got 'fast'"),
    ("tiny", "train.lr", "fast", "train.lr: expected a number, got 'fast' (not a number literal)"),
    ("quick", "train.lr", NAN, "is out of range"),
    ("tiny", "train.lr", NAN, "train.lr: nan is out of range; expected finite, > 0"),
    ("tiny", "train.lr", INF, "train.lr: inf is out of range"),
    ("quick", "train.lr", 1.0e30, "1e+30 is out of range; expected finite, > 0 and <= 1"),  # issue 28
    ("quick", "source", "elsewhere.yaml", "the loader sets it to the file a config came from"),  # issue 28
    ("quick", "train.warmup_steps", -1, "-1 is out of range; expected 0 <= warmup_steps < steps"),
    ("quick", "train.warmup_steps", 10, "10 is out of range; expected 0 <= warmup_steps < steps"),
    ("tiny", "train.warmup_steps", 40, "warmup_steps: 40 is out of range; expected 0 <= warmup_steps < steps=40"),
    ("quick", "train.schedule", "zigzag", "'zigzag' is not one of ['cosine', 'linear', 'constant']"),
    ("quick", "train.grad_accum", 0, "0 is out of range; expected >= 1"),
    ("quick", "train.log_every", 0, "0 is out of range; expected >= 1"),
    ("quick", "train.cuda_graph", "yes", "expected bool, got 'yes'"),
    ("quick", "train.graph_warmup_steps", 0, "0 is out of range; expected >= 1"),
    ("quick", "train.seed", "x", "expected int, got 'x'"),
    ("quick", "train.optimizer", "sgd", "unknown key(s) ['optimizer']"),
    ("tiny", "train.lerning_rate", 3, "tiny.yaml.train: unknown key(s) ['lerning_rate']"),
    # values that used to load and then silently ruin training, or fail late inside torch/transformers (issue 8)
    ("tiny", "train.max_grad_norm", -1, "train.max_grad_norm: -1.0 is out of range; expected null (no clipping) or"),
    ("tiny", "train.max_grad_norm", 0, "train.max_grad_norm: 0.0 is out of range"),
    ("tiny", "train.min_lr_ratio", -1, "train.min_lr_ratio: -1.0 is out of range; expected 0 <= x <= 1"),
    ("tiny", "train.min_lr_ratio", 5, "train.min_lr_ratio: 5.0 is out of range"),
    ("tiny", "train.weight_decay", -1, "train.weight_decay: -1.0 is out of range; expected finite, >= 0"),
    ("quick", "tier", None, "expected str, got None"),
    ("quick", "extra_top", 1, "unknown key(s) ['extra_top']"),
    ("tiny", "colour", "blue", "unknown key(s) ['colour']"),
    ("quick", "criteria.nonsense", 3, "unknown key(s) ['nonsense']"),
    ("convergence", "criteria.loss_drop_min", 1.5, "1.5 is out of range; expected null or 0 < x < 1"),
    ("convergence", "criteria.loss_drop_min", -0.1, "-0.1 is out of range"),
    ("convergence", "criteria.loss_window", 0, "0 is out of range"),
    ("convergence", "criteria.loss_window", 60, "60 is out of range; expected >= 1, and two windows must fit"),
    ("tiny", "criteria.loss_window", 30, "criteria.loss_window: 30 is out of range; expected >= 1, and two windows"),
    ("convergence", "criteria.control_perturbation", 0, "0.0 is out of range; expected 0 < x < 1"),
    ("convergence", "criteria.control_runs", 0, "criteria.control_runs: 0 is out of range; expected 1 <= x <= 16"),
    ("convergence", "criteria.loss_match_floor", -1, "-1.0 is out of range; expected null or finite, >= 0"),
    ("extended", "criteria.stall_fraction_max", 1.0, "1.0 is out of range; expected null or 0 < x < 1"),
] + [
    ("extended", f"criteria.{name}", -1, "-1.0 is out of range; expected null or finite, > 0")
    for name in POSITIVE_CRITERIA
]


def _changed(base: str, key: str, value, where: Path) -> Path:
    """Tier ``base``'s YAML with ``key`` (dotted) set to ``value`` (removed for ``DEL``), written into ``where``."""
    raw = yaml.safe_load(((where if base == "tiny" else CONFIG_DIR) / f"{base}.yaml").read_text())
    node, keys = raw, key.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value == DEL:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    out = where / f"{base}.yaml"
    out.write_text(yaml.safe_dump(raw))  # NaN and inf as YAML's .nan and .inf
    return out


def _id(base: str, key: str, value) -> str:
    return f"{base}-{key}={value!r}"


@pytest.mark.parametrize("base, key, value, expected", TIER_CASES, ids=[_id(*c[:3]) for c in TIER_CASES])
def test_tier_yaml(base, key, value, expected, config_dir):
    path = _changed(base, key, value, config_dir)
    with pytest.raises(ConfigError) as err:
        load_tier_config(path, None if base == "tiny" else CONFIG_DIR)
    msg = str(err.value)
    assert expected in msg, msg
    leaf = key.split(".")[-1]
    assert leaf in msg or key.split(".")[0] in msg or "model config" in msg, f"the key is not named: {msg}"


# ------------------------------------------------------------------ files that are no tier YAML
FILE_CASES = [
    ("not YAML at all", "lora: [unclosed", "malformed YAML"),
    ("an unclosed list", "tier: [unclosed\n", "malformed YAML"),
    ("a list at the top", "- 1\n- 2\n", "expected a mapping at the top level, got list"),
    ("a scalar at the top", "42\n", "expected a mapping at the top level, got int"),
    ("empty file", "", "expected a mapping at the top level"),
    ("binary junk", "\x00\x01\x02", "malformed YAML"),
    # issue 28: PyYAML kept the second silently
    (
        "a section given twice",
        "tier: quick\nmodel: smollm2-135m\nlora:\n  r: 4\nlora:\n  r: 8\n",
        "'lora' is given twice",
    ),
]


@pytest.mark.parametrize("what, text, expected", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_tier_yaml_file(what, text, expected, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_tier_config(path, CONFIG_DIR)


def test_tier_yaml_that_does_not_exist(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config .*missing.yaml"):
        load_tier_config(tmp_path / "missing.yaml", CONFIG_DIR)


# ------------------------------------------------------------------ model YAML (configs/models/<name>.yaml)
# (base model, key, bad value): the message names both; "tiny-llama" is the CPU tests' model, loaded through its tier
MODEL_CASES = [
    ("smollm2-135m", "hidden_size", 0),
    ("smollm2-135m", "hidden_size", -64),
    ("smollm2-135m", "num_hidden_layers", 0),
    ("smollm2-135m", "num_attention_heads", 0),
    ("smollm2-135m", "intermediate_size", 0),
    ("smollm2-135m", "vocab_size", 0),
    ("smollm2-135m", "hidden_size", "wide"),
    ("smollm2-135m", "num_attention_heads", 7),
    ("tiny-llama", "hidden_size", 0),
    ("tiny-llama", "num_attention_heads", 5),  # does not divide the hidden size
    ("tiny-llama", "num_key_value_heads", 3),  # does not divide the heads
]


@pytest.mark.parametrize("base, key, value", MODEL_CASES, ids=[_id(*c) for c in MODEL_CASES])
def test_model_yaml(base, key, value, config_dir):
    models = config_dir / "models"
    raw = yaml.safe_load(((models if base == "tiny-llama" else CONFIG_DIR / "models") / f"{base}.yaml").read_text())
    raw["architecture"][key] = value
    path = models / f"{base}.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as err:
        if base == "tiny-llama":
            load_tier_config(config_dir / "tiny.yaml")
        else:
            load_model_config(str(path), CONFIG_DIR)
    msg = str(err.value)
    assert "architecture." in msg and key in msg and repr(value) in msg, msg


def test_model_name_that_is_not_known():
    with pytest.raises(
        ConfigError, match=r"model config 'llama-9' not found .* known models: \[.*'llama-2-7b', .*'smollm2-135m'"
    ):
        load_model_config("llama-9", CONFIG_DIR)
