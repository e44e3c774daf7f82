"""The multinode launcher and its verdicts on the CPU: two torchrun nodes of one gloo rank each, meeting at a c10d
rendezvous on localhost, training the tiny Llama: the same code path two hosts take."""

from __future__ import annotations

import sys

import pytest
import torch

from lora_suite.scenarios import multigpu as M
from lora_suite.scenarios import multinode as MN


def test_each_node_runs_torchrun_with_the_rendezvous_and_its_own_index():
    rdzv = MN.Rendezvous("10.0.0.5:29500", "multinode-ddp", 2, 4, join_timeout_s=90)
    cmd = MN.node_command(rdzv, 1, "c.yaml", "out", mode="fsdp", dcp_at=10, stop=(1, 3))
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[3:11] == [
        "--nnodes=2",
        "--nproc-per-node=4",
        "--node-rank=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.5:29500",
        "--rdzv-id=multinode-ddp",
        "--rdzv-conf=join_timeout=90,is_host=false",  # node 0 hosts the store
        "--max-restarts=0",
    ]
    assert cmd[11:13] == ["-m", "lora_suite.scenarios.multigpu_worker"]
    assert cmd[-7:] == ["--node-index", "1", "--dcp-at", "10", "--stop", "1", "3"]
    assert "is_host=true" in MN.node_command(rdzv, 0, "c.yaml", "out")[9]
    assert "--plant-dcp-no-optimizer" in MN.node_command(rdzv, 0, "c.yaml", "out", plant_dcp_no_optimizer=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"endpoint": "hostA"}, "rendezvous endpoint 'hostA': expected HOST:PORT"),
        ({"endpoint": "hostA:70000"}, "'hostA:70000': expected HOST:PORT with a port from 1 to 65535"),
        ({"nnodes": 0}, "nnodes=0, nproc_per_node=4: expected both >= 1"),
        ({"job_id": "a b"}, "rendezvous id 'a b': expected letters"),
    ],
)
def test_a_bad_rendezvous_is_refused_naming_the_value(kwargs, message):
    args = {"endpoint": "h:1", "job_id": "j", "nnodes": 2, "nproc_per_node": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        MN.Rendezvous(**args)
    with pytest.raises(ValueError, match="node 2: expected 0 to 1 for a job of 2 node"):
        MN.Rendezvous("h:1", "j", 2, 1).torchrun_args(2)


def test_one_host_splits_its_gpus_into_nodes_and_across_hosts_runs_its_own_node():
    one = MN.topology(4)
    assert (one.nnodes, one.nproc_per_node, one.local_nodes, one.devices) == (2, 2, (0, 1), ("0,1", "2,3"))
    assert one.judge and one.endpoint is None and one.rendezvous("j", 30).endpoint.startswith("127.0.0.1:")
    assert MN.topology(5, nodes=2).devices == ("0,1", "2,3")  # the fifth GPU idles: nodes are of equal size
    two = MN.topology(8, nodes=2, node_rank=1, endpoint="hostA:29500")
    assert (two.nproc_per_node, two.local_nodes, two.devices, two.judge) == (8, (1,), None, False)
    follower = two.rendezvous("j", 30, job_index=2)  # job 2 of the tier's list meets at PORT + 2
    assert follower.endpoint == "hostA:29502" and follower.join_timeout_s == follower.read_timeout_s == 3600
    assert "read_timeout=3600" in follower.torchrun_args(1)[6]  # it waits while node 0's host judges the job before
    judge = MN.topology(8, nodes=2, node_rank=0, endpoint="hostA:29500").rendezvous("j", 30, job_index=0)
    assert (judge.endpoint, judge.join_timeout_s, judge.read_timeout_s) == ("hostA:29500", 30, None)
    with pytest.raises(ValueError, match="across hosts every job of every node needs its index"):
        two.rendezvous("j", 30)
    with pytest.raises(ValueError, match="1 GPU.s. visible: 2 nodes on one host need at least 2"):
        MN.topology(1)
    with pytest.raises(ValueError, match="--node-rank 2: expected 0 to 1 with --rdzv-endpoint"):
        MN.topology(8, node_rank=2, endpoint="hostA:29500")
    with pytest.raises(ValueError, match="--nodes 1: a multinode job has at least 2 nodes"):
        MN.topology(8, nodes=1)
    with pytest.raises(ValueError, match="3 GPU.s. do not split into 2 nodes"):
        MN.split_devices(3, 2)


def test_digest_and_round_trip_verdicts_name_the_ranks():
    same = {"adapter_digests": ["a", "a", "b", "a"]}
    assert MN.digest_disagreements([same]) == [2]
    ok = {"rank": 0, "dcp_round_trip": {"steps_differing": [], "adapters_equal": True, "max_abs_loss_gap": 0.0}}
    bad = {"rank": 3, "dcp_round_trip": {"steps_differing": [6, 7], "adapters_equal": False, "max_abs_loss_gap": 0.5}}
    assert MN.round_trip_failures([ok]) == []
    assert MN.round_trip_failures([ok, bad]) == ["rank 3: steps [6, 7] differ (max |gap| 0.5), adapters differ"]


@pytest.fixture
def twelve_steps(config_dir):
    path = config_dir / "tiny.yaml"
    path.write_text(path.read_text().replace("steps: 40", "steps: 12"))
    return path


def _two_nodes(cfg, out, job, **worker):
    rdzv = MN.Rendezvous(f"127.0.0.1:{MN.free_port()}", job, 2, 1, join_timeout_s=30)
    return MN.launch_nodes(rdzv, [0, 1], cfg, out, timeout_s=240, device="cpu", **worker)


def test_two_nodes_train_like_one_process_agree_bitwise_and_round_trip_their_dcp_checkpoint(twelve_steps, tmp_path):
    res = _two_nodes(twelve_steps, tmp_path / "ddp", "ddp", mode="ddp", dcp_at=5)
    one = M.launch(twelve_steps, tmp_path / "one", 1, timeout_s=240, device="cpu")
    assert res.ok and one.returncode == 0, res.summary() + one.stderr[-2000:]
    assert sorted(r["node"] for r in res.ranks) == [0, 1] and [r["rank"] for r in res.ranks] == [0, 1]
    assert MN.digest_disagreements(res.ranks) == [] and len(set(res.ranks[0]["adapter_digests"])) == 1
    assert MN.round_trip_failures(res.ranks) == []
    assert all(r["dcp_round_trip"]["at"] == 5 for r in res.ranks)
    assert (tmp_path / "ddp" / "dcp" / ".metadata").exists()  # DCP's own layout: metadata and per-rank shards
    torch.testing.assert_close(
        torch.tensor(res.ranks[0]["losses"]), torch.tensor(one.ranks[0]["losses"]), rtol=1e-4, atol=0
    )  # fp32 on the CPU: the split over nodes changes only the summation order
    assert [h["step"] for h in res.heartbeats] == [11, 11] and {h["node"] for h in res.heartbeats} == {0, 1}


def test_fsdp2_over_two_nodes_round_trips_and_the_planted_defects_are_seen(twelve_steps, tmp_path):
    fsdp = _two_nodes(twelve_steps, tmp_path / "fsdp", "fsdp", mode="fsdp", dcp_at=5)
    planted = _two_nodes(twelve_steps, tmp_path / "p", "p", mode="fsdp", dcp_at=5, plant_dcp_no_optimizer=True)
    unsynced = _two_nodes(twelve_steps, tmp_path / "u", "u", mode="ddp", steps=10, plant_no_sync=True)
    assert fsdp.ok and planted.ok and unsynced.ok, fsdp.summary() + planted.summary() + unsynced.summary()
    assert MN.round_trip_failures(fsdp.ranks) == [] and MN.digest_disagreements(fsdp.ranks) == []
    assert (tmp_path / "fsdp" / "adapter" / "adapter_model.safetensors").exists()  # the gathered PEFT folder
    failures = MN.round_trip_failures(planted.ranks)
    assert len(failures) == 2 and all("adapters differ" in f for f in failures), failures
    assert planted.ranks[0]["dcp_round_trip"]["steps_differing"][0] == 6  # step 5 runs on the loaded adapters
    assert MN.digest_disagreements(unsynced.ranks) == [1]


def test_a_node_that_stops_itself_ends_the_job_and_is_named_by_its_ranks(twelve_steps, tmp_path):
    res = _two_nodes(twelve_steps, tmp_path / "lost", "lost", mode="ddp", stop=(1, 3))
    assert not res.timed_out and res.seconds < 120 and not res.ok
    ends = {n.node: n.returncode for n in res.nodes}
    assert ends[1] == -9 and ends[0] not in (0, None), res.summary()  # the survivor fails, it does not hang
    lost = MN.lost_nodes(res)
    assert list(lost) == [1] and lost[1]["last_steps"] == [3] and lost[1]["signal"] == 9
    assert lost[1]["ranks"] == [h["rank"] for h in res.heartbeats if h["node"] == 1]
    survivor = next(h["rank"] for h in res.heartbeats if h["node"] == 0)  # c10d's order: rank 0 or 1
    summary = res.summary()  # the survivor's own error, in the report (gloo words a lost peer in more than one way)
    assert f"[rank{survivor}]: RuntimeError" in summary and "remote worker" in summary, summary
    assert res.ranks == []  # no job record: nothing pretends the job finished


def test_a_node_that_never_joins_is_named_after_the_join_timeout(twelve_steps, tmp_path):
    rdzv = MN.Rendezvous(f"127.0.0.1:{MN.free_port()}", "alone", 2, 1, join_timeout_s=5)
    res = MN.launch_nodes(rdzv, [0], twelve_steps, tmp_path / "alone", timeout_s=120, device="cpu")
    why = MN.not_joined(res)
    assert not res.timed_out and res.seconds < 60 and why is not None, res.summary()
    assert "node(s) [0] started here, node(s) [1] never joined" in why and "waited 5 s for 2 nodes" in why
    assert MN.not_joined(_fake_finished(rdzv)) is None


def _fake_finished(rdzv):
    return MN.JobResult(rdzv, [MN.NodeExit(0, 0, "", "")], 1.0, [], [{"rank": 0, "node": 0, "step": 3}])


def test_node_0_clears_what_an_earlier_job_left_in_a_reused_folder(tmp_path):
    for stale in ("job.json", "rank0.json", "heartbeat/rank0.json", "dcp/.metadata", "node0.err"):
        (tmp_path / stale).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / stale).write_text("{}")
    MN.clear_job_folder(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node0.err"]  # the logs are rewritten by the next launch


def test_a_node_that_arrives_before_node_0_waits_for_it(twelve_steps, tmp_path):
    """Across hosts node 1 often comes first (node 0's host is still judging the job before): with the follower's
    read timeout it waits for node 0's store instead of failing at once."""
    import threading
    import time

    port = MN.free_port()
    early = MN.Rendezvous(f"127.0.0.1:{port}", "wait", 2, 1, join_timeout_s=60, read_timeout_s=60)
    done: dict = {}
    waiting = threading.Thread(
        target=lambda: done.update(n1=MN.launch_nodes(early, [1], twelve_steps, tmp_path, timeout_s=200, device="cpu"))
    )
    waiting.start()
    time.sleep(8)  # node 1's agent is up and waiting for a store nobody hosts yet
    node0 = MN.Rendezvous(f"127.0.0.1:{port}", "wait", 2, 1, join_timeout_s=60)
    res = MN.launch_nodes(node0, [0], twelve_steps, tmp_path, timeout_s=200, device="cpu")
    waiting.join()
    assert res.nodes[0].returncode == 0 and done["n1"].nodes[0].returncode == 0, res.summary() + done["n1"].summary()
    assert len(res.ranks) == 2 and {r["node"] for r in res.ranks} == {0, 1}
