"""The longcontext tier's settings (``configs/longcontext.yaml``): it loads with every rule passing, the tier registry
finds it with its test folder, marker and figures, its order is its own, and the thresholds it shares with other
tiers are theirs (the YAML's comments say whose)."""

from __future__ import annotations

import dataclasses

import pytest

from lora_suite.settings.config import CONFIG_DIR, ConfigError
from lora_suite.settings.loader import load_tier_config
from lora_suite.settings.registry import broken_tiers, find_tiers_dir, registry


def test_the_yaml_loads_at_the_models_full_context_with_checkpointing():
    cfg = load_tier_config(CONFIG_DIR / "longcontext.yaml")
    assert cfg.tier == "longcontext" and cfg.model.name == "smollm2-135m"
    assert cfg.data.seq_len == cfg.model.architecture.max_position_embeddings == 8192
    assert (cfg.data.batch_size, cfg.dtype, cfg.lora.targets) == (1, "bfloat16", ("all-linear",))
    assert cfg.train.gradient_checkpointing and not cfg.train.cuda_graph
    assert cfg.criteria.grad_accum_k is None  # batch 1 splits into no micro-batches
    assert 2 * cfg.criteria.loss_window <= cfg.train.steps


def test_its_shared_thresholds_are_the_tiers_it_names():
    crit = load_tier_config(CONFIG_DIR / "longcontext.yaml").criteria
    quick = load_tier_config(CONFIG_DIR / "quick.yaml").criteria
    memory = load_tier_config(CONFIG_DIR / "memory.yaml").criteria
    assert (crit.grad_match_factor, crit.grad_loss_floor) == (quick.grad_match_factor, quick.grad_loss_floor)
    assert crit.memory_estimate_error_max == memory.memory_estimate_error_max
    assert crit.loss_drop_min is not None and 0 < crit.loss_drop_min < 0.30  # below the convergence tier's bar


def test_the_registry_finds_the_tier_with_its_folder_marker_and_figures():
    tiers = registry()
    assert "longcontext" not in broken_tiers()
    tier = tiers["longcontext"]
    assert tier.tests_dir == find_tiers_dir() / "longcontext"
    assert (tier.tests_dir / "test_longcontext_tier.py").is_file()
    assert tier.marker == "longcontext" and tier.entry.in_all and tier.entry.gpus == 1
    assert [f.name for f in tier.entry.figures] == ["tokens per second (device time)", "peak GPU memory"]
    assert [f.clock for f in tier.entry.figures] == ["device", "device"]


def test_no_two_tiers_share_an_order():
    orders = [t.entry.order for t in registry().values()]
    assert len(orders) == len(set(orders)), orders


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("seq_len", 8193, "data.seq_len: 8193 is out of range; expected .*max_position_embeddings=8192"),
        ("grad_accum_k", 2, "criteria.grad_accum_k: 2 is out of range; expected .*batch_size=1"),
    ],
)
def test_a_longer_window_than_the_model_or_an_accumulation_check_of_batch_1_is_refused(key, value, message):
    cfg = load_tier_config(CONFIG_DIR / "longcontext.yaml")
    with pytest.raises(ConfigError, match=message):
        if key == "seq_len":
            dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=value))
        else:
            dataclasses.replace(cfg, criteria=dataclasses.replace(cfg.criteria, grad_accum_k=value))
