"""Fixtures for the framework's CPU tests: a tiny Llama (2 layers, hidden 64: ``lora_suite.engine.models.TINY_LLAMA``),
its configs, and the tiny tier prepared on the CPU."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import yaml

from lora_suite.engine.models import TINY_LLAMA
from lora_suite.settings.loader import load_tier_config

TINY_ARCH = TINY_LLAMA

SCORECARD_RUNS = [  # recorded run excerpts of cupy, PEFT and a bench run (tests/fixtures/runs/README.md)
    "20261122T055613Z-quick-peft",
    "20261122T055703Z-convergence-peft",
    "20261122T055903Z-memory-peft",
    "20261122T055507Z-quick",
    "20261122T061557Z-memory",
    "20261122T061702Z-convergence",
    "20261122T134747Z-bench",
]

TINY_MODEL_YAML = yaml.safe_dump(
    {"name": "tiny-llama", "checkpoint": "nobody/tiny-llama", "architecture": dataclasses.asdict(TINY_ARCH)},
    sort_keys=False,
)

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


@pytest.fixture
def tiny_prepared(tiny_cfg):
    """A factory: the tiny tier prepared on the CPU (``lora_suite.engine.prepare.Prepared``: model, adapters, batches)
    with the implementation named (default the torch reference)."""
    from lora_suite.engine.prepare import prepare

    def make(implementation: str = "torch"):
        return prepare(tiny_cfg, "cpu", implementation=implementation)

    return make


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread (on a busy two-core machine, two threads made each float64 reference 30x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
