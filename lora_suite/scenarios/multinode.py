"""Multi-node runs on torchrun's c10d rendezvous (issue 59): one torchrun per node, the nodes meeting at one endpoint.

Every node runs the same command but for its node index:

    python -m torch.distributed.run --nnodes=N --nproc-per-node=P --node-rank=K --rdzv-backend=c10d
        --rdzv-endpoint=HOST:PORT --rdzv-id=JOB --rdzv-conf=join_timeout=S,is_host=(K == 0) --max-restarts=0
        -m lora_suite.scenarios.multigpu_worker ... --node-index K

Node 0 hosts the rendezvous store at HOST:PORT (``is_host``); the others connect to it. The rendezvous closes when N
nodes have joined, or fails after ``join_timeout`` seconds: the verdict of a node that never joins. Under c10d,
``--node-rank`` is only a label: torch assigns ranks in the rendezvous's own order, so which ranks live on which
node is read from the ranks themselves (their heartbeats, ``lora_suite.scenarios.multinode_checks``).

``launch_nodes`` starts the nodes this host runs: every node, where one host is split into nodes (each node its
own ``CUDA_VISIBLE_DEVICES``: 2 nodes × 2 GPUs on a 4-GPU host), or one node of a job whose other nodes run on other
hosts with the same command and their own ``--node-rank``. The path is the same in both cases: the nodes meet only
through the endpoint and the collectives, never through this process. With several hosts the output folder must
be one every node sees (a shared filesystem): the DCP checkpoint's shards are written by every rank, and
``job.json`` by rank 0, wherever it runs.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lora_suite.scenarios.multigpu import failure_lines, launch_env, worker_args
from lora_suite.scenarios.multinode_checks import read_heartbeats
from lora_suite.scenarios.process_tree import kill_tree


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` → (host, port); anything else is an error naming the text."""
    m = re.fullmatch(r"(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})", text or "")
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise ValueError(f"rendezvous endpoint {text!r}: expected HOST:PORT with a port from 1 to 65535")
    return m.group(1), int(m.group(2))


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the nodes of one job meet (module docstring)."""

    endpoint: str  # HOST:PORT of node 0, where the c10d store listens
    job_id: str  # the rendezvous id: one per job, the same on every node
    nnodes: int
    nproc_per_node: int
    join_timeout_s: int = 120
    read_timeout_s: int | None = None  # how long a node waits for the store to answer (torch's default: 60 s)

    def __post_init__(self) -> None:
        parse_endpoint(self.endpoint)
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise ValueError(f"nnodes={self.nnodes}, nproc_per_node={self.nproc_per_node}: expected both >= 1")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.job_id):
            raise ValueError(f"rendezvous id {self.job_id!r}: expected letters, digits, '.', '_' or '-'")

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node

    def torchrun_args(self, node: int) -> list[str]:
        """torchrun's options for node ``node`` of this job."""
        if not 0 <= node < self.nnodes:
            raise ValueError(f"node {node}: expected 0 to {self.nnodes - 1} for a job of {self.nnodes} node(s)")
        conf = f"join_timeout={self.join_timeout_s},is_host={'true' if node == 0 else 'false'}"
        if self.read_timeout_s is not None:
            conf += f",read_timeout={self.read_timeout_s}"
        return [
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--node-rank={node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.job_id}",
            f"--rdzv-conf={conf}",
            "--max-restarts=0",
        ]


def node_command(
    rdzv: Rendezvous,
    node: int,
    config: str | Path,
    out: str | Path,
    *,
    dcp_at: int | None = None,
    plant_dcp_no_optimizer: bool = False,
    stop: tuple[int, int] | None = None,
    **worker,
) -> list[str]:
    """The whole command of node ``node``: torchrun with the rendezvous, then the worker (``worker``: the options of
    ``multigpu.worker_args``) with ``--node-index`` (not ``--node``: torchrun reads an abbreviation of its own
    options even after the module), the DCP round trip after step ``dcp_at`` − 1 and the planted faults: ``stop``
    = (node, step) stops that node after that step."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv.torchrun_args(node)]
    cmd += worker_args(config, out, **worker) + ["--node-index", str(node)]
    if dcp_at is not None:
        cmd += ["--dcp-at", str(dcp_at)]
    if plant_dcp_no_optimizer:
        cmd += ["--plant-dcp-no-optimizer"]
    if stop is not None:
        cmd += ["--stop", str(stop[0]), str(stop[1])]
    return cmd


def split_devices(visible: int, nnodes: int) -> list[str]:
    """One host's ``visible`` GPUs split into ``nnodes`` nodes of equal size: each node's CUDA_VISIBLE_DEVICES."""
    if nnodes < 1 or visible % nnodes:
        raise ValueError(f"{visible} GPU(s) do not split into {nnodes} nodes of equal size")
    per = visible // nnodes
    return [",".join(str(d) for d in range(k * per, (k + 1) * per)) for k in range(nnodes)]


@dataclass(frozen=True)
class NodeExit:
    node: int
    returncode: int | None  # None: still running at the job's timeout, then killed; < 0: ended by that signal
    stdout: str
    stderr: str


@dataclass(frozen=True)
class JobResult:
    rdzv: Rendezvous
    nodes: list[NodeExit]  # the nodes this host started
    seconds: float
    ranks: list[dict]  # job.json: every rank's record, in rank order (empty when the job did not finish)
    heartbeats: list[dict]  # every rank's last heartbeat found in the output folder

    @property
    def ok(self) -> bool:
        return all(n.returncode == 0 for n in self.nodes) and len(self.ranks) == self.rdzv.world

    @property
    def timed_out(self) -> bool:
        return any(n.returncode is None for n in self.nodes)

    def summary(self) -> str:
        """One line per node: how it ended and its first errors (``multigpu.failure_lines``)."""
        lines = []
        for n in self.nodes:
            how = "timed out" if n.returncode is None else f"exit {n.returncode}"
            errors = failure_lines(n.stderr + "\n" + n.stdout)
            lines.append(f"node {n.node}: {how}" + (f"; {errors}" if errors else ""))
        return "\n".join(lines)


def launch_nodes(
    rdzv: Rendezvous, nodes: list[int], config, out, *, timeout_s: float, devices: list[str] | None = None, **worker
) -> JobResult:
    """Start ``nodes`` of the job (node 0 first: it hosts the store) and wait for all of them, killing what still
    runs at ``timeout_s``. ``devices``: each started node's CUDA_VISIBLE_DEVICES (None: inherited). Each node's
    output goes to ``<out>/node<K>.out`` and ``.err`` (files, not pipes: a node blocked on a full pipe would hold up
    the others' collectives). Never raises for a failed job: the result says."""
    import json

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if 0 in nodes:
        clear_job_folder(out)
    procs = {}
    began = time.perf_counter()
    for i, node in enumerate(sorted(nodes)):
        env = launch_env()
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices[i]
        cmd = node_command(rdzv, node, config, out, **worker)
        with open(out / f"node{node}.out", "w") as so, open(out / f"node{node}.err", "w") as se:
            procs[node] = subprocess.Popen(cmd, stdout=so, stderr=se, env=env, start_new_session=True)
    exits = []
    for node, proc in procs.items():
        try:
            rc: int | None = proc.wait(timeout=max(began + timeout_s - time.perf_counter(), 0.1))
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)  # torchrun and every rank it started
            proc.wait()
            rc = None
        exits.append(NodeExit(node, rc, (out / f"node{node}.out").read_text(), (out / f"node{node}.err").read_text()))
    job = out / "job.json"
    ranks = json.loads(job.read_text()) if job.exists() else []
    return JobResult(rdzv, exits, time.perf_counter() - began, ranks, read_heartbeats(out))


def clear_job_folder(out: Path) -> None:
    """Remove what an earlier job left in ``out`` (its record, heartbeats, ranks' results, checkpoint), so that nothing
    of it is read as this job's. Node 0's launcher does it, before its torchrun starts: no rank of any node writes
    before the rendezvous, which node 0 hosts, has closed."""
    import shutil

    for stale in ("job.json", "heartbeat", "dcp", "adapter", "probe.safetensors", "adapters.safetensors"):
        path = out / stale
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for path in out.glob("rank*.json"):
        path.unlink()


def lost_nodes(result: JobResult) -> dict[int, dict]:
    """The nodes this host started that ended by a signal before the job's timeout (a node lost: killed, out of
    memory, powered off), each with its ranks and how far they got, from their heartbeats:
    {node: {"ranks": [...], "last_steps": [...], "signal": n}}."""
    lost = {}
    for n in result.nodes:
        if n.returncode is not None and n.returncode < 0:
            beats = [h for h in result.heartbeats if h["node"] == n.node]
            lost[n.node] = {
                "ranks": [h["rank"] for h in beats],
                "last_steps": [h["step"] + 1 for h in beats],  # steps done (a heartbeat carries the 0-based step)
                "signal": -n.returncode,
            }
    return lost


def not_joined(result: JobResult) -> str | None:
    """Why the rendezvous never closed, naming the nodes missing from it, or None when it closed."""
    if result.heartbeats or not any("RendezvousTimeoutError" in n.stderr for n in result.nodes):
        return None
    started = sorted(n.node for n in result.nodes)
    missing = [k for k in range(result.rdzv.nnodes) if k not in started]
    return (
        f"the rendezvous at {result.rdzv.endpoint} (job {result.rdzv.job_id}) waited {result.rdzv.join_timeout_s} s "
        f"for {result.rdzv.nnodes} nodes and closed without them: node(s) {started} started here, node(s) "
        f"{missing or 'unknown'} never joined; no rank ran"
    )


FOLLOWER_WAIT_S = 3600  # a node other than node 0 waits this long for node 0, which runs the references in between


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous on localhost)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Topology:
    """The nodes of the tier's jobs and which of them this host runs (module docstring).

    One host (no endpoint): every node here, each ``nproc_per_node`` of the visible GPUs, a rendezvous on localhost.
    Across hosts: this host runs node ``local_nodes[0]`` on all its visible GPUs; node 0's host judges."""

    nnodes: int
    nproc_per_node: int
    local_nodes: tuple[int, ...]
    devices: tuple[str, ...] | None  # CUDA_VISIBLE_DEVICES per local node; None: every visible GPU
    endpoint: str | None  # node 0's HOST:PORT; None: one host, a free localhost port per job

    @property
    def judge(self) -> bool:
        return 0 in self.local_nodes

    def rendezvous(self, job_id: str, join_timeout_s: int, *, job_index: int | None = None) -> Rendezvous:
        """The rendezvous of one job of every node. Across hosts, job ``job_index`` of the tier's fixed list meets at
        node 0's PORT + ``job_index``: a node never reaches the store of another job (one that is still ending, say),
        and a node other than node 0, which may arrive while node 0's host still judges the job before, waits for
        the store and the others ``follower_wait_s``. On one host: a free localhost port."""
        if self.endpoint is None:
            return self.local_rendezvous(job_id, join_timeout_s, self.nnodes)
        if job_index is None:
            raise ValueError(f"job {job_id!r}: across hosts every job of every node needs its index in the tier's list")
        host, port = parse_endpoint(self.endpoint)
        wait = None if self.judge else FOLLOWER_WAIT_S
        return Rendezvous(
            f"{host}:{port + job_index}", job_id, self.nnodes, self.nproc_per_node, wait or join_timeout_s, wait
        )

    def local_rendezvous(self, job_id: str, join_timeout_s: int, nnodes: int) -> Rendezvous:
        """A job of this host's nodes only (``nnodes`` of them, here), on a free localhost port."""
        return Rendezvous(f"127.0.0.1:{free_port()}", job_id, nnodes, self.nproc_per_node, join_timeout_s)


def topology(visible: int, nodes: int | None = None, node_rank: int | None = None, endpoint: str | None = None):
    """The ``Topology`` of ``visible`` GPUs on this host and the tier's options (``--nodes``, ``--node-rank``,
    ``--rdzv-endpoint``); a ValueError names what does not fit."""
    nnodes = 2 if nodes is None else nodes
    if nnodes < 2:
        raise ValueError(f"--nodes {nnodes}: a multinode job has at least 2 nodes")
    if endpoint is None:
        if visible < nnodes:
            raise ValueError(f"{visible} GPU(s) visible: {nnodes} nodes on one host need at least {nnodes}")
        per = visible // nnodes
        return Topology(nnodes, per, tuple(range(nnodes)), tuple(split_devices(per * nnodes, nnodes)), None)
    parse_endpoint(endpoint)
    if node_rank is None or not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank}: expected 0 to {nnodes - 1} with --rdzv-endpoint")
    if visible < 1:
        raise ValueError("no GPU visible: a node runs one process per visible GPU")
    return Topology(nnodes, visible, (node_rank,), None, endpoint)


def digest_disagreements(ranks: list[dict]) -> list[int]:
    """The ranks whose adapters' digest differs from rank 0's, read from the all-gathered list every rank holds."""
    digests = ranks[0]["adapter_digests"] if ranks else []
    return [r for r, d in enumerate(digests) if d != digests[0]]


def round_trip_failures(ranks: list[dict]) -> list[str]:
    """Per rank whose DCP round trip was not bitwise (``dcp_round_trip``), what differed."""
    bad = []
    for r in ranks:
        trip = r["dcp_round_trip"]
        if trip["steps_differing"] or not trip["adapters_equal"]:
            bad.append(
                f"rank {r['rank']}: steps {trip['steps_differing'][:5]} differ (max |gap| "
                f"{trip['max_abs_loss_gap']:.3g}), adapters {'equal' if trip['adapters_equal'] else 'differ'}"
            )
    return bad
