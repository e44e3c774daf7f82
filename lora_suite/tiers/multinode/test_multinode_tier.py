"""multinode tier (issue 59): LoRA training whose ranks live on several nodes, one torchrun per node, the nodes meeting
at torchrun's c10d rendezvous (lora_suite/scenarios/multinode.py launches every job with a timeout).

Where the nodes run: on one host (the default) every node runs here, each with its own CUDA_VISIBLE_DEVICES (2 nodes
x 2 GPUs on a 4-GPU host); across hosts (``--rdzv-endpoint HOST:PORT --node-rank K --shared-dir DIR``) each host runs
the same tests and starts its own node of every job, and node 0's host judges. The code path is the same: the nodes
meet only through the rendezvous and the collectives.

Jobs, from the same seed (configs/multinode.yaml):
  single, control   one process with the whole batch, and it with lora_A perturbed by bf16 roundoff (node 0 only)
  one node          DDP on one node's GPUs: the base of the scaling figure (node 0 only)
  ddp, fsdp         DDP and FSDP2 over every node, each with the DCP round trip after step resume_at_step - 1
  planted           the round trip loading the adapters alone; DDP without gradient averaging; a node that stops
                    itself after step 3; a rendezvous whose other nodes never come (node 0 only)
Checks: the loss of each multi-node run within max(factor·e(t), floor) of the one-process run's (e(t) the control's
running gap: the multigpu and convergence tiers' band); every rank's adapter digest equal to rank 0's (all-gathered);
the DCP round trip bitwise on every rank; the base untouched; every rank served by the implementation's path; the
loss falls; the PEFT folder gathered from the FSDP2 shards reloads into one GPU with the sharded model's logits and
PEFT's own loader reads it; the scaling efficiency over node counts (a figure until calibrated); each planted defect
caught; a lost node ends the job within rank_failure_seconds_max naming its ranks; a node that never joins is named.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from lora_suite.harness.loss_band import LossBand, judge_loss_band
from lora_suite.harness.tier import Tier
from lora_suite.measure.criteria import loss_drop
from lora_suite.scenarios import multinode as MN
from lora_suite.scenarios.multigpu import launch, scaling_efficiency
from lora_suite.settings.config import CONFIG_DIR, TierConfig

pytestmark = [pytest.mark.gpu, pytest.mark.multinode]
CONFIG = CONFIG_DIR / "multinode.yaml"
JOB_TIMEOUT_S = 420
# The jobs that span nodes, in the order every host runs them; across hosts job i meets at node 0's PORT + i.
JOBS = ("ddp", "fsdp", "planted-dcp", "planted-no-sync", "node-lost", "never-joined")
SOURCE = "configs/multinode.yaml"


@dataclasses.dataclass
class Jobs:
    """The tier's jobs as this host runs them: the topology, the config, where the jobs write, the implementation."""

    tier: Tier
    topo: MN.Topology
    cfg: TierConfig
    base: Path  # the shared folder across hosts, else the test's tmp_path
    at: int  # criteria.resume_at_step: the DCP round trip's checkpoint step
    join_s: float  # criteria.rendezvous_join_seconds
    end_s: float  # criteria.rank_failure_seconds_max

    def run(self, name: str, *, nnodes: int | None = None, nodes=None, **worker) -> MN.JobResult:
        """Job ``name`` (its rendezvous id ``multinode-<name>``, its port across hosts from its place in ``JOBS``, the
        same on every host); this host's nodes of it. ``nnodes``: a job of this host's nodes only (one-node)."""
        if nnodes is not None:
            rdzv = self.topo.local_rendezvous(f"multinode-{name}", int(self.join_s), nnodes)
        else:
            rdzv = self.topo.rendezvous(f"multinode-{name}", int(self.join_s), job_index=JOBS.index(name))
        started = list(self.topo.local_nodes if nodes is None else nodes)
        devices = list(self.topo.devices[: len(started)]) if self.topo.devices else None
        res = MN.launch_nodes(
            rdzv,
            started,
            CONFIG,
            self.base / name,
            timeout_s=JOB_TIMEOUT_S + (rdzv.read_timeout_s or 0),  # a follower also waits for node 0
            devices=devices,
            implementation=self.tier.impl.name,
            **worker,
        )
        self.tier.report.notes.append(
            f"{self.tier.nodeid}: {name} job, {rdzv.nnodes} node(s) x {rdzv.nproc_per_node} GPU(s), node(s) "
            f"{started} on this host, rendezvous {rdzv.endpoint}: {res.seconds:.1f} s\n{res.summary()}"
        )
        return res

    def require(self, res: MN.JobResult, what: str) -> MN.JobResult:
        """``res`` if it finished with every rank's record; else the test fails with each node's end and errors."""
        if not res.ok:
            pytest.fail(
                f"{what} job did not finish with every rank's record after {res.seconds:.0f} s:\n{res.summary()}"
            )
        return res


def _jobs(tier, request, tmp_path) -> Jobs:
    """This host's part of the tier, from the options; a skip naming the GPU count where they do not fit."""
    opt = request.config.getoption
    shared = opt("shared_dir")
    try:
        topo = MN.topology(torch.cuda.device_count(), opt("nodes"), opt("node_rank"), opt("rdzv_endpoint"))
    except ValueError as exc:
        pytest.skip(f"the multinode tier does not fit here: {exc}")
    cfg = tier.config("multinode")
    crit = cfg.criteria
    needed = ("resume_at_step", "rendezvous_join_seconds", "rank_failure_seconds_max", "loss_match_factor",
              "loss_match_floor", "control_perturbation")  # fmt: skip
    if unset := [k for k in needed if getattr(crit, k) is None]:
        pytest.fail(f"{SOURCE}: criteria {unset} are null; the multinode tier judges with each of them")
    assert crit.resume_at_step and crit.rendezvous_join_seconds and crit.rank_failure_seconds_max  # checked above
    base = Path(shared) if shared else tmp_path
    return Jobs(tier, topo, cfg, base, crit.resume_at_step, crit.rendezvous_join_seconds, crit.rank_failure_seconds_max)


def _follower_checks(jobs: Jobs, results: dict[str, MN.JobResult]) -> None:
    """On a host that runs node K > 0: its node of each job exited 0 (the job is judged on node 0's host)."""
    for name, res in results.items():
        node = res.nodes[0]
        jobs.tier.check(f"node {node.node} of the {name} job: exit 0", node.returncode, "==", 0, detail=res.summary())


def _parity(jobs: Jobs, name: str, ranks: list[dict], single: dict, control: dict) -> None:
    crit, tier, world, nodes = jobs.cfg.criteria, jobs.tier, len(ranks), jobs.topo.nnodes
    band = LossBand(
        f"per-step loss: {name} over {world} ranks on {nodes} nodes vs one GPU",
        "one GPU",
        f"{name} {world} ranks",
        f"{name}: steps where the {nodes}-node loss leaves the band around the one-GPU loss",
        f"max(loss_match_factor*e(t), loss_match_floor): {SOURCE}",
    )
    judge_loss_band(
        tier,
        band,
        ranks[0]["losses"],
        single["losses"],
        control["losses"],
        crit.loss_match_factor,
        crit.loss_match_floor,
    )
    drop = loss_drop(ranks[0]["losses"], crit.loss_window)
    tier.check(f"{name}: loss drop over the run", round(drop, 4), ">=", crit.loss_drop_min, source=SOURCE)


def _ended_within(tier, res: MN.JobResult, what: str, limit: float, source: str) -> None:
    """The job ended by itself (not killed at the timeout) within ``limit`` seconds."""
    tier.check(f"the job {what} ended (not killed at the timeout)", res.timed_out, "==", False)
    tier.check(f"seconds until the job {what} ended", round(res.seconds, 1), "<=", limit, source=source)


def _agreement(jobs: Jobs, name: str, ranks: list[dict]) -> None:
    tier = jobs.tier
    tier.check(
        f"{name}: ranks whose adapters' digest differs from rank 0's (SHA-256 of the whole tensors, all-gathered)",
        len(MN.digest_disagreements(ranks)),
        "==",
        0,
        detail=str(MN.digest_disagreements(ranks)),
    )
    bad = MN.round_trip_failures(ranks)
    tier.check(
        f"{name}: ranks whose DCP round trip is not bitwise (checkpoint after step {jobs.at - 1}, trained on again)",
        len(bad),
        "==",
        0,
        detail="; ".join(bad[:4]),
    )
    tier.check(f"{name}: ranks whose frozen base weights changed", sum(not r["base_untouched"] for r in ranks), "==", 0)
    path = tier.impl.expected_path
    served = sorted({r["served_by"] for r in ranks})
    tier.check(
        f"{name}: ranks not served by the implementation's path ({path})",
        sum(r["served_by"] != path for r in ranks),
        "==",
        0,
        detail=str(served),
    )
    nodes = sorted({r["node"] for r in ranks})
    tier.check(f"{name}: nodes that took part", len(nodes), "==", jobs.topo.nnodes, detail=f"nodes {nodes}")


def _peft_folder(jobs: Jobs, out) -> None:
    """The FSDP2 job's PEFT folder, gathered from the shards: lora_core's loader into one GPU gives the sharded
    model's logits on the probe batch (bitwise up to the reduction order: the multigpu tier's tolerance), and PEFT's
    own loader reads the same tensors."""
    from safetensors.torch import load_file

    tier, cfg = jobs.tier, jobs.cfg
    probe = load_file(str(out / "probe.safetensors"))
    prepared = tier.prepare(cfg)
    with torch.no_grad():
        untrained = prepared.model(input_ids=probe["input_ids"].cuda()).logits.float().cpu()
    prepared.implementation.load_adapter(prepared.model, out / "adapter")  # the implementation's own loader
    with torch.no_grad():
        logits = prepared.model(input_ids=probe["input_ids"].cuda()).logits.float().cpu()
    tier.check(
        "fsdp: max |logits(fresh, untrained) - logits(FSDP2 model)|: the adapters trained (the reload check's control)",
        float((untrained - probe["logits"]).abs().max()),
        ">",
        1e-2,
    )
    tier.check(
        "fsdp: max |logits(one GPU, reloaded) - logits(FSDP2 model over the nodes)| on the probe batch",
        float((logits - probe["logits"]).abs().max()),
        "<=",
        1e-2,
        source="the multigpu tier's reload tolerance (tiers/multigpu): same weights, other reduction order",
    )
    _peft_reads(jobs, prepared, out / "adapter")


def _peft_reads(jobs: Jobs, trained, folder) -> None:
    tier, cfg = jobs.tier, jobs.cfg
    try:
        import peft  # noqa: F401
    except ImportError as exc:
        tier.check.not_applicable("fsdp: PEFT's loader reads the gathered folder", f"peft does not import ({exc})")
        return
    from lora_suite.engine.models import build_model
    from lora_suite.engine.prepare import DTYPES, adapter_spec
    from lora_suite.judges import peft_folder as PF

    def base():
        return build_model(cfg.model, cfg.weights, DTYPES[cfg.dtype], "cuda", seed=cfg.train.seed).model

    for v in PF.peft_loader(trained, base, folder, adapter_spec(cfg, None)):
        tier.check(f"fsdp: {v.name}", v.value, v.op, v.threshold, source=v.source, detail=v.detail)


def test_ddp_and_fsdp2_over_nodes_match_one_gpu(tier, request, tmp_path):
    jobs = _jobs(tier, request, tmp_path)
    at = jobs.at
    results = {name: jobs.run(name, mode=name, dcp_at=at) for name in ("ddp", "fsdp")}
    if not jobs.topo.judge:
        return _follower_checks(jobs, results)
    impl, crit = tier.impl.name, jobs.cfg.criteria
    single, control = (
        launch(CONFIG, tmp_path / name, 1, timeout_s=JOB_TIMEOUT_S, implementation=impl, perturb=p)
        for name, p in (("single", 0.0), ("control", crit.control_perturbation or 0.0))
    )
    for name, one in (("single", single), ("control", control)):
        if one.returncode != 0 or not one.ranks:
            pytest.fail(f"the one-GPU {name} job exited {one.returncode}: {one.stderr[-2000:]}")
    one_node = jobs.require(jobs.run("one-node", nnodes=1, nodes=[0], mode="ddp"), "one-node")
    for name, res in results.items():
        ranks = jobs.require(res, name).ranks
        _parity(jobs, name, ranks, single.ranks[0], control.ranks[0])
        _agreement(jobs, name, ranks)
    _peft_folder(jobs, jobs.base / "fsdp")
    _scaling(jobs, results["ddp"].ranks, one_node.ranks, single.ranks[0])


def _scaling(jobs: Jobs, ranks: list[dict], one_node: list[dict], single: dict) -> None:
    tier, crit, n = jobs.tier, jobs.cfg.criteria, jobs.topo.nnodes
    tokens_n, tokens_1 = (sum(r["local_tokens_per_s"] for r in rs) for rs in (ranks, one_node))
    eff = scaling_efficiency(tokens_n, n, tokens_1)
    tier.report.add_row(
        tier.nodeid,
        "multi-node throughput, DDP (median tokens/s after warm-up, summed over ranks)",
        ("nodes", "GPUs per node", "tokens/s", "one node tokens/s", "one GPU tokens/s", "efficiency over nodes"),
        (n, jobs.topo.nproc_per_node, round(tokens_n), round(tokens_1), round(single["local_tokens_per_s"]), eff),
    )
    if crit.scaling_efficiency_min is None:
        tier.check.not_applicable(
            "scaling efficiency over nodes: floor",
            f"no floor calibrated yet (measured {eff:.3f}; {SOURCE} scaling_efficiency_min)",
        )
    else:
        tier.check(
            "scaling efficiency, tokens/s on N nodes / (N x one node)",
            round(eff, 3),
            ">=",
            crit.scaling_efficiency_min,
            source=f"{SOURCE} scaling_efficiency_min",
        )


def test_the_checks_catch_their_planted_defects(tier, request, tmp_path):
    jobs = _jobs(tier, request, tmp_path)
    at = jobs.at
    results = {
        "planted-dcp": jobs.run("planted-dcp", mode="fsdp", dcp_at=at, steps=at + 3, plant_dcp_no_optimizer=True),
        "planted-no-sync": jobs.run("planted-no-sync", mode="ddp", steps=12, plant_no_sync=True),
    }
    if not jobs.topo.judge:
        return _follower_checks(jobs, results)
    trips = jobs.require(results["planted-dcp"], "planted-dcp").ranks
    tier.check(
        "the round-trip check's control: ranks whose DCP round trip is not bitwise when the load leaves AdamW's "
        "state out (planted)",
        len(MN.round_trip_failures(trips)),
        ">=",
        1,
        source="the check must fail on the defect it exists for",
        detail="; ".join(MN.round_trip_failures(trips)[:2]),
    )
    unsynced = jobs.require(results["planted-no-sync"], "planted-no-sync").ranks
    tier.check(
        "the digest check's control: ranks whose digest differs from rank 0's when gradients are never averaged "
        "(planted: no DDP)",
        len(MN.digest_disagreements(unsynced)),
        ">=",
        1,
        source="the check must fail on the defect it exists for",
    )


def test_a_lost_node_ends_the_job_and_is_named(tier, request, tmp_path):
    jobs = _jobs(tier, request, tmp_path)
    lost = jobs.topo.nnodes - 1  # never node 0: it hosts the rendezvous store
    res = jobs.run("node-lost", mode="ddp", steps=12, stop=(lost, 3))  # two loss windows and the resume step fit
    if not jobs.topo.judge:
        mine = res.nodes[0]
        if mine.node == lost:
            want, got = "ended by SIGKILL (the planted node loss)", mine.returncode == -9
        else:
            want, got = (
                "ended with a failure (it lost a peer), not killed at the timeout",
                mine.returncode not in (0, None),
            )
        tier.check(f"node {mine.node} of the node-lost job: {want}", got, "==", True, detail=res.summary())
        return
    _ended_within(tier, res, "that lost a node", jobs.end_s, f"{SOURCE} rank_failure_seconds_max")
    tier.check("nodes that ended with exit 0 after losing a node", sum(n.returncode == 0 for n in res.nodes), "==", 0)
    named = MN.lost_nodes(res)
    beats = sorted(h["rank"] for h in res.heartbeats if h["node"] == lost)
    if jobs.topo.endpoint is None:  # one host: the lost node was started here, its end is seen here
        tier.check(
            f"ranks named as lost with node {lost} (its ranks by their heartbeats: {beats})",
            named.get(lost, {}).get("ranks"),
            "==",
            beats,
            detail=str(named),
        )
    tier.report.notes.append(f"{tier.nodeid}: lost node(s): {named or 'none seen here'}; heartbeats {res.heartbeats}")
    tier.check("ranks with a heartbeat on the lost node", len(beats), "==", jobs.topo.nproc_per_node)


def test_a_node_that_never_joins_is_named(tier, request, tmp_path):
    jobs = _jobs(tier, request, tmp_path)
    if not jobs.topo.judge:
        pytest.skip("node 0's host runs this job alone: the other nodes stay away on purpose")
    res = jobs.run("never-joined", nodes=[0], mode="ddp", steps=12)
    why = MN.not_joined(res)
    tier.report.notes.append(f"{tier.nodeid}: {why}")
    limit, source = jobs.join_s + jobs.end_s, f"{SOURCE} rendezvous_join_seconds + rank_failure_seconds_max"
    _ended_within(tier, res, "whose other nodes never joined", limit, source)
    missing = list(range(1, jobs.topo.nnodes))
    tier.check(
        f"the verdict names the nodes that never joined ({missing})",
        why is not None and f"node(s) {missing} never joined" in why,
        "==",
        True,
        detail=why or res.summary(),
    )
