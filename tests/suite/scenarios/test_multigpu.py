"""The multi-GPU launcher and rank logic on the CPU: torchrun with gloo, two processes, the tiny Llama."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lora_suite.harness.modules import load_test_module
from lora_suite.scenarios import multigpu as M

ROOT = Path(__file__).resolve().parents[3]


def test_the_command_is_torchrun_over_the_worker_and_multicast_is_off():
    cmd = M.launch_command("c.yaml", "out", 2, implementation="cupy", steps=5)
    assert cmd[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert cmd[5:7] == ["-m", "lora_suite.scenarios.multigpu_worker"] and "--implementation" in cmd and "cupy" in cmd
    env = M.launch_env({"PATH": "/bin"})
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["PATH"] == "/bin"
    with pytest.raises(ValueError, match="mode 'allreduce' is not one of"):
        M.launch_command("c.yaml", "out", 2, mode="allreduce")
    planted = M.launch_command("c.yaml", "out", 2, mode="fsdp", batch_size=2, plant_no_reshard=True)
    assert planted[-3:] == ["--batch-size", "2", "--plant-no-reshard"]
    assert "--plant-no-reshard" not in M.launch_command("c.yaml", "out", 2, mode="fsdp")
    assert M.launch_command("c.yaml", "out", 2, plant_no_sync=True)[-1] == "--plant-no-sync"
    with pytest.raises(ValueError, match="nproc=0 must be >= 1"):
        M.launch_command("c.yaml", "out", 0)


def test_each_rank_gets_its_block_of_rows_and_a_batch_that_does_not_split_is_named():
    batch = {"input_ids": torch.arange(8).view(4, 2), "labels": torch.arange(8).view(4, 2)}
    assert M.rank_rows(batch, 1, 2)["input_ids"].tolist() == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match="4 rows, not divisible by 3 ranks"):
        M.rank_rows(batch, 0, 3)


def test_adapter_gaps_band_and_refusals():
    single = {"a": torch.ones(4), "b": torch.full((2,), 2.0)}
    control = {"a": torch.ones(4) * 1.01, "b": torch.full((2,), 2.0)}  # d(control): 0.01 and 0
    inside = {"a": torch.ones(4) * 1.03, "b": torch.full((2,), 2.0 + 2**-12)}
    rows, beyond = M.adapter_gaps(inside, single, control, 4, 2**-10)
    assert beyond == [] and rows[0][0] == "a" and rows[0][3] == pytest.approx(0.04)
    outside = {"a": torch.ones(4) * 1.05, "b": torch.full((2,), float("nan"))}
    assert M.adapter_gaps(outside, single, control, 4, 2**-10)[1] == ["a", "b"]
    with pytest.raises(ValueError, match="different adapters"):
        M.adapter_gaps({"a": torch.ones(4)}, single, control, 4, 0.0)


def test_scaling_efficiency_and_failure_summary():
    assert M.scaling_efficiency(150.0, 2, 100.0) == 0.75
    err = (
        "[rank0]: RuntimeError: Connection closed by peer\n[rank1]: RuntimeError: planted failure on rank 1 at "
        "step 3\nRoot Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n"
    )
    summary = M.failure_summary(M.LaunchResult(2, 1, 3.0, "", err, []))
    assert summary.startswith("root cause: rank 1") and "[rank1]: RuntimeError: planted failure" in summary
    assert M.failure_summary(M.LaunchResult(2, 0, 3.0, "", "all fine", [])) is None


@pytest.fixture
def short_cfg(config_dir):
    path = config_dir / "tiny.yaml"
    path.write_text(path.read_text().replace("steps: 40", "steps: 12"))
    return path


def test_two_gloo_ranks_agree_bitwise_and_match_one_process(short_cfg, tmp_path):
    two = M.launch(short_cfg, tmp_path / "two", 2, timeout_s=240, device="cpu")
    one = M.launch(short_cfg, tmp_path / "one", 1, timeout_s=240, device="cpu")
    assert two.returncode == 0 and one.returncode == 0, two.stderr[-3000:] + one.stderr[-3000:]
    assert [r["rank"] for r in two.ranks] == [0, 1]
    for r in two.ranks:
        assert r["adapters_differing_from_rank0"] == [] and r["base_untouched"] and r["served_by"] == "torch"
    assert two.ranks[0]["losses"] == two.ranks[1]["losses"]  # the all-reduced global loss
    # fp32 on the CPU: the split changes only the summation order
    torch.testing.assert_close(
        torch.tensor(two.ranks[0]["losses"]), torch.tensor(one.ranks[0]["losses"]), rtol=1e-4, atol=0
    )
    from safetensors.torch import load_file

    control = M.launch(short_cfg, tmp_path / "control", 1, timeout_s=240, device="cpu", perturb=2**-8)
    assert control.returncode == 0, control.stderr[-3000:]
    saved = {k: load_file(str(tmp_path / k / "adapters.safetensors")) for k in ("two", "one", "control")}
    rows, beyond = M.adapter_gaps(saved["two"], saved["one"], saved["control"], 4, 2**-10)
    assert beyond == [] and len(rows) == len(saved["one"])
    assert all(d_control > d_multi for _, d_multi, d_control, _ in rows)  # fp32 reorder << a 2^-8 start
    planted = M.launch(short_cfg, tmp_path / "planted", 2, timeout_s=240, device="cpu", plant_no_sync=True)
    assert planted.returncode == 0, planted.stderr[-3000:]
    assert all(r["adapters_differing_from_rank0"] for r in planted.ranks)  # the rank check sees unsynced ranks


def test_a_planted_failure_on_rank_1_ends_the_job_and_names_the_rank(short_cfg, tmp_path):
    res = M.launch(short_cfg, tmp_path / "fail", 2, timeout_s=120, device="cpu", mode="fail", fail_at=3)
    assert not res.timed_out and res.returncode not in (0, None)
    summary = M.failure_summary(res)
    assert "[rank1]: RuntimeError: planted failure on rank 1 at step 3" in summary, summary
    assert "root cause: rank" in summary  # torchrun's first observed failure: rank 1 or, racing it, rank 0
    assert res.ranks == []  # no rank wrote a result: nothing pretends the job finished


def test_the_tier_skips_with_fewer_than_two_gpus_saying_how_many(monkeypatch):
    tier_mod = load_test_module(ROOT / "tiers/multigpu/test_multigpu_tier.py", "multigpu_tier")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    class Request:
        class config:
            @staticmethod
            def getoption(name):
                return None

    with pytest.raises(pytest.skip.Exception, match="needs at least 2 GPUs; found 1 visible"):
        tier_mod.gpus_for_run(Request)


def test_fsdp2_on_two_gloo_ranks_trains_like_one_process_and_saves_a_peft_folder_that_reloads(short_cfg, tmp_path):
    """FSDP2 (fully_shard) over two gloo ranks: the same losses as one process, base untouched, and the PEFT folder
    gathered from the shards loads into a fresh one-process model that reproduces the sharded model's logits."""
    from safetensors.torch import load_file

    from lora_core.adapters import load_peft_adapter
    from lora_suite.engine.prepare import prepare
    from lora_suite.settings.loader import load_tier_config

    two = M.launch(short_cfg, tmp_path / "two", 2, timeout_s=240, device="cpu", mode="fsdp")
    one = M.launch(short_cfg, tmp_path / "one", 1, timeout_s=240, device="cpu", mode="fsdp")
    assert two.returncode == 0 and one.returncode == 0, two.stderr[-3000:] + one.stderr[-3000:]
    assert [r["sharded"] for r in two.ranks] == [True, True] and one.ranks[0]["sharded"] is False
    for r in two.ranks:
        assert r["base_untouched"] and r["served_by"] == "torch" and r["adapters_differing_from_rank0"] is None
    torch.testing.assert_close(
        torch.tensor(two.ranks[0]["losses"]), torch.tensor(one.ranks[0]["losses"]), rtol=1e-4, atol=0
    )
    probe = load_file(str(tmp_path / "two" / "probe.safetensors"))
    fresh = prepare(load_tier_config(short_cfg), "cpu")  # same seed: the same base, untrained adapters
    with torch.no_grad():
        untrained = fresh.model(input_ids=probe["input_ids"]).logits.float()
    assert load_peft_adapter(fresh.model, tmp_path / "two" / "adapter")
    with torch.no_grad():
        reloaded = fresh.model(input_ids=probe["input_ids"]).logits.float()
    assert not torch.allclose(untrained, probe["logits"], rtol=0, atol=1e-4)  # the adapters did train
    torch.testing.assert_close(reloaded, probe["logits"], rtol=1e-5, atol=1e-5)


def test_the_fsdp_peak_bound_and_its_memory_terms():
    from lora_core.inject import adapter_parameters, inject_lora
    from lora_suite.engine.models import build_tiny_llama

    model = build_tiny_llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3)
    inject_lora(model, ["q_proj"], 2, 4, backend="torch")
    adapters = adapter_parameters(model)
    t = M.memory_terms(model, adapters)
    layer = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    root = sum(p.numel() * 4 for p in (model.model.embed_tokens.weight, model.model.norm.weight, model.lm_head.weight))
    adapter = sum(p.numel() * 4 for p in adapters.values())
    assert t["largest_layer_params"] == layer and t["root_own_params"] == root and t["adapters"] == adapter
    assert t["sharded"] == t["params"] + 3 * adapter and t["transient"] == root + 3 * layer
    # P - S(1 - 1/F) + T: a 10 GB one-GPU peak of which 8 GB shard, 1 GB gathered at once
    assert M.fsdp_peak_bound(10e9, {"sharded": 8e9, "transient": 1e9}, 2) == 7e9
    assert M.fsdp_peak_bound(10e9, {"sharded": 8e9, "transient": 1e9}, 1) == 11e9
    with pytest.raises(ValueError, match="sharding factor 0 must be >= 1"):
        M.fsdp_peak_bound(1.0, {"sharded": 0, "transient": 0}, 0)
    with pytest.raises(ValueError, match="has no model.layers"):
        M.decoder_layers(torch.nn.Linear(2, 2))


def test_base_checksums_change_when_one_bit_of_a_frozen_weight_changes():
    lin = torch.nn.Linear(4, 3).to(torch.bfloat16).requires_grad_(False)
    before = M.base_checksums(lin)
    assert set(before) == {"weight", "bias"} and M.base_checksums(lin) == before
    with torch.no_grad():
        lin.weight.view(-1).view(torch.int16)[5] += 1  # the smallest change: one unit in the last place
    assert M.base_checksums(lin)["weight"] != before["weight"] and M.base_checksums(lin)["bias"] == before["bias"]
