"""Fixtures for the framework's CPU tests: a tiny Llama (2 layers, hidden 64) and its configs."""

from __future__ import annotations

import textwrap

import pytest

from lora_suite.core.config import LlamaArchitecture
from lora_suite.core.loader import load_tier_config

TINY_ARCH = LlamaArchitecture(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    tie_word_embeddings=False,
)

SCORECARD_RUNS = [  # recorded run excerpts of cupy, PEFT and a bench run (tests/fixtures/runs/README.md)
    "20261122T055613Z-quick-peft",
    "20261122T055703Z-convergence-peft",
    "20261122T055903Z-memory-peft",
    "20261122T055507Z-quick",
    "20261122T061557Z-memory",
    "20261122T061702Z-convergence",
    "20261122T134747Z-bench",
]

TINY_MODEL_YAML = """\
name: tiny-llama
checkpoint: nobody/tiny-llama
architecture:
  hidden_size: 64
  intermediate_size: 128
  num_hidden_layers: 2
  num_attention_heads: 4
  num_key_value_heads: 2
  vocab_size: 300
  tie_word_embeddings: false
"""

TINY_TIER_YAML = """\
tier: tiny
model: tiny-llama
weights: random
dtype: float32
implementation: torch
lora: {targets: [all-linear], r: 4, alpha: 8}
data: {batch_size: 4, seq_len: 32, pool: 4}
train: {steps: 40, lr: 1.0e-2, warmup_steps: 4, log_every: 20}
criteria: {loss_drop_min: 0.02, loss_window: 5}
"""


@pytest.fixture
def config_dir(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny-llama.yaml").write_text(TINY_MODEL_YAML)
    (tmp_path / "tiny.yaml").write_text(TINY_TIER_YAML)
    return tmp_path


@pytest.fixture
def tiny_cfg(config_dir):
    return load_tier_config(config_dir / "tiny.yaml")


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path
