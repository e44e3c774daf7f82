"""What a rank of a multinode job checks and leaves behind (issue 59), beside what every multigpu rank does
(``lora_suite.scenarios.multigpu_worker``).

heartbeat     ``<out>/heartbeat/rank<r>.json`` after every step: the rank, its node, host, pid and the step. When a
              node is lost the survivors' collectives fail and no rank writes a result; the heartbeats are what
              tells, afterwards, which ranks lived on the node that went and how far each got.
stop a node   the planted fault of the node-loss check: at step S the node's local rank 0 kills its torchrun agent
              and every rank the agent started (``process_tree.kill_tree``), as a host that loses power would.
              It is done by the node itself, so it is the same fault on one host split into nodes and on two hosts.
digests       every rank's adapters after training, as one SHA-256 over the whole tensors (gathered where FSDP2
              shards them) in name order, all-gathered: replicas that drifted apart by one bit are named by rank.
DCP round trip  the sharded checkpoint (``torch.distributed.checkpoint``) written after step K − 1 and read back
              into the same model and optimizer at the end: training steps K .. end again from it must give the
              same losses and the same adapter bits as the first time. Each rank writes and reads its own shards;
              on several hosts the folder must be one every node sees.
job record    rank 0 gathers every rank's result and writes ``<out>/job.json``: one file holds the whole job
              wherever rank 0 ran (c10d assigns ranks in its own order, not by ``--node-rank``).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path


def write_json_atomically(path: Path, data) -> None:
    """``data`` as JSON through a temporary file and a rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


class Heartbeat:
    """A ``train`` step hook that records, after every step, where this rank is (module docstring)."""

    def __init__(self, out: str | Path, rank: int, node: int, local_rank: int) -> None:
        self.path = Path(out) / "heartbeat" / f"rank{rank}.json"
        self.info = {"rank": rank, "node": node, "local_rank": local_rank, "host": socket.gethostname()}
        self.info["pid"] = os.getpid()
        self(-1)  # joined, before the first step

    def __call__(self, step: int) -> None:
        write_json_atomically(self.path, {**self.info, "step": step})


def read_heartbeats(out: str | Path) -> list[dict]:
    """Every rank's last heartbeat under ``out``, in rank order."""
    found = [json.loads(p.read_text()) for p in (Path(out) / "heartbeat").glob("rank*.json")]
    return sorted(found, key=lambda h: h["rank"])


def stop_node_hook(node: int, local_rank: int, stop_node: int | None, stop_at: int | None):
    """The step hook of the planted node loss: on node ``stop_node``, local rank 0 kills the node (its torchrun agent,
    the parent of this process, and every rank the agent started, itself last) once step ``stop_at`` (counted from 1)
    is done. Every other node, rank and step trains on."""
    from lora_suite.scenarios.process_tree import kill_tree

    armed = stop_node is not None and stop_at is not None and node == stop_node and local_rank == 0

    def hook(step: int) -> None:
        if armed and step + 1 == stop_at:
            kill_tree(os.getppid())

    return hook


def adapters_digest(adapters: dict) -> str:
    """SHA-256 over every adapter tensor's bytes, whole (a collective where FSDP2 shards them), in name order."""
    from lora_core.adapters import full_tensor
    from lora_suite.scenarios.multigpu import as_bits

    h = hashlib.sha256()
    for name in sorted(adapters):
        t = full_tensor(adapters[name].detach()).contiguous().cpu()
        h.update(name.encode())
        h.update(as_bits(t.view(-1)).numpy().tobytes())
    return h.hexdigest()


def ranks_digests(adapters: dict) -> list[str]:
    """Every rank's ``adapters_digest``, all-gathered: element r is rank r's."""
    import torch.distributed as dist

    mine = adapters_digest(adapters)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def write_job_record(out: str | Path, result: dict) -> None:
    """Gather every rank's ``result`` on rank 0, which writes them, in rank order, to ``<out>/job.json``."""
    import torch.distributed as dist

    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, result)
    if dist.get_rank() == 0:
        write_json_atomically(Path(out) / "job.json", every)


def record_job(result: dict, adapters: dict, out: str | Path, node: int) -> None:
    """A multinode rank's additions to its ``result``: its node and every rank's adapter digest (all-gathered); then
    the job record rank 0 writes (``write_job_record``)."""
    result["node"] = node
    result["adapter_digests"] = ranks_digests(adapters)
    write_job_record(out, result)
