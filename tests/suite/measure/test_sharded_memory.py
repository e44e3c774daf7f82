"""The per-rank plan of an FSDP2 run (``lora_suite.measure.sharded_memory``): the derivation the multigpu tier's bound
uses, taken on paper, against the one measured point the ledger holds (Llama-2-7B over two FSDP2 ranks)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from lora_suite.measure.memory import GIB
from lora_suite.measure.sharded_memory import plan_per_rank, sharded_peak
from lora_suite.settings.loader import load_model_config, load_tier_config

ROOT = Path(__file__).resolve().parents[3]
MEASURED_RUN = "20261122T112440Z-multigpu"  # multigpu_fsdp.yaml on two H200s: the largest per-rank peak, in GiB


def test_the_derivation_and_its_factor():
    assert sharded_peak(10.0, 8.0, 1.0, 2) == 7.0
    assert sharded_peak(10.0, 8.0, 1.0, 1) == 11.0  # unsharded: the gathered layers come on top
    with pytest.raises(ValueError, match="sharding factor 0"):
        sharded_peak(10.0, 8.0, 1.0, 0)


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_a_70b_plan_falls_with_the_ranks_and_nf4_is_below_the_16_bit_base(quantize):
    from lora_suite.settings.config import AdapterSpec

    arch = load_model_config("llama-2-70b").architecture
    spec = AdapterSpec(("all-linear",), 16, 32.0, quantize=quantize)
    plans = [plan_per_rank(arch, spec, world=w, batch_per_rank=1, seq_len=2048) for w in (2, 4, 8)]
    assert plans[0].peak > plans[1].peak > plans[2].peak > plans[2].transient > 0
    assert all(p.sharded < p.one_gpu for p in plans)  # activations and logits are not sharded
    if quantize:
        bf16 = plan_per_rank(arch, AdapterSpec(("all-linear",), 16, 32.0), world=8, batch_per_rank=1, seq_len=2048)
        assert plans[2].peak < bf16.peak


def test_bad_plan_inputs_name_the_value():
    from lora_suite.settings.config import AdapterSpec

    arch = load_model_config("llama-2-7b").architecture
    with pytest.raises(ValueError, match="world=0"):
        plan_per_rank(arch, AdapterSpec(("q_proj",), 8, 16.0), world=0, batch_per_rank=1, seq_len=8)


def test_the_7b_plan_is_within_30_percent_of_the_measured_rank_peak():
    """The multigpu_fsdp tier's config (Llama-2-7B, bf16 base, all-linear r16, B/N rows per rank) over two ranks,
    planned, against the per-rank peak the ledger holds for it."""
    cfg = load_tier_config(ROOT / "lora_suite" / "configs" / "multigpu_fsdp.yaml")
    with gzip.open(ROOT / "reports" / "ledger.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    (measured,) = [
        r["value"]
        for r in rows
        if r.get("run_id") == MEASURED_RUN and r.get("check", "").startswith("largest per-rank peak over 2 FSDP2")
    ]
    plan = plan_per_rank(
        cfg.model.architecture,
        cfg.lora,
        world=2,
        batch_per_rank=cfg.data.batch_size // 2,
        seq_len=cfg.data.seq_len,
        gradient_checkpointing=cfg.train.gradient_checkpointing,
        dtype=cfg.dtype,
    )
    assert abs(plan.peak / GIB / measured - 1) <= 0.30, (plan.peak / GIB, measured)


def test_the_plan_table_of_docs_scaling_is_what_the_plan_computes():
    from lora_suite.settings.config import AdapterSpec

    rows = [ln for ln in (ROOT / "docs" / "scaling.md").read_text().splitlines() if ln.startswith("| llama-2-")]
    assert len(rows) == 4
    for row in rows:
        name, base, *figures = [c.strip() for c in row.strip("|").split("|")]
        arch = load_model_config(name).architecture
        spec = AdapterSpec(("all-linear",), 16, 32.0, quantize="nf4" if base == "NF4" else None)
        plans = [plan_per_rank(arch, spec, world=w, batch_per_rank=1, seq_len=2048) for w in (2, 4, 8)]
        expected = [f"{p.peak / GIB:.2f}" for p in plans] + [f"{plans[0].one_gpu / GIB:.2f}"]
        assert figures == expected, (row, expected)
