"""Multi-GPU runs on torch.distributed (issue 11): the worker every rank runs, and the launcher (torchrun).

The tier test (tiers/multigpu) stays one pytest process that writes the report; it launches the runs with
``launch`` — ``python -m torch.distributed.run --nproc-per-node N -m lora_suite.multigpu ...`` — so a hung or
failed rank ends in a subprocess with a timeout and an exit code, never in the test process itself.

Worker modes (``--mode``):
    ddp     DistributedDataParallel over the adapters (the frozen base is not a DDP parameter). The global batch
            B of each step is split by rows: rank r trains rows [r·B/N, (r+1)·B/N). DDP averages the gradients,
            and with equal label counts per rank (fixed-length windows) the average of the ranks' mean losses is
            the global mean, so the N-rank run takes the same steps as one process with the whole batch, up to
            rounding (the GEMMs see other shapes). With one rank it is that one-process run.
    fail    the same, and rank ``--fail-rank`` raises at step ``--fail-at`` (a planted failure): the job must
            end, not hang on the next collective.
Each rank writes ``<out>/rank<r>.json``: its per-step global losses (the mean of the ranks' losses, all-reduced
after the run), local tokens/s, whether its base weights are bitwise untouched, and how many adapter tensors
differ from rank 0's (all-gathered, compared bitwise). Rank 0 also saves the adapters
(``<out>/adapters.safetensors``) for the comparison with the one-GPU run.

Environment of every launched process: ``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` keep
NVLink multicast (NVLS) off: the shared GPU hosts this suite runs on do not allow multicast objects, and NCCL or
symmetric memory that try to create them fail or hang at the first collective there.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}  # why: module docstring
MODES = ("ddp", "fail")


@dataclass(frozen=True)
class LaunchResult:
    nproc: int
    returncode: int | None  # None: killed at the timeout
    seconds: float
    stdout: str
    stderr: str
    ranks: list[dict]  # the rank<r>.json files that were written, in rank order

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def launch_command(config: str | Path, out: str | Path, nproc: int, *, mode: str = "ddp",
                   implementation: str | None = None, device: str = "cuda", steps: int | None = None,
                   perturb: float = 0.0, fail_rank: int = 1, fail_at: int = 3) -> list[str]:
    """The torchrun command line of one run (``--standalone``: a local rendezvous on a free port)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be >= 1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "lora_suite.multigpu", "--config", str(config), "--out", str(out), "--mode", mode,
           "--device", device, "--perturb", repr(perturb), "--fail-rank", str(fail_rank), "--fail-at", str(fail_at)]
    if implementation:
        cmd += ["--implementation", implementation]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    return cmd


def launch_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the launched processes: the caller's, with NVLink multicast off (module docstring)."""
    env = dict(os.environ if base is None else base)
    env.update(MULTICAST_OFF)
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # a failed collective raises instead of hanging
    return env


def launch(config: str | Path, out: str | Path, nproc: int, *, timeout_s: float, **kw) -> LaunchResult:
    """Run one job under torchrun; kill it at ``timeout_s``. Never raises for a failed job: the result says."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = launch_command(config, out, nproc, **kw)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env(),
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the whole group: torchrun and every worker
        stdout, stderr = proc.communicate()
        rc = None
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"), key=lambda p: int(p.stem[4:]))]
    return LaunchResult(nproc, rc, time.perf_counter() - t0, stdout, stderr, ranks)


def failure_summary(result: LaunchResult) -> str | None:
    """What the job's output says failed: torchrun's root-cause rank and each rank's first error line
    (``[rankN]: SomeError: message``); None when there is neither."""
    import re
    text = result.stderr + "\n" + result.stdout
    first: dict[str, str] = {}
    for ln in text.splitlines():
        m = re.match(r"\[rank(\d+)\]: \w+(\.\w+)*(Error|Exception)\b", ln)
        if m and m.group(1) not in first:
            first[m.group(1)] = ln.strip()
    root = re.search(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+)", text, re.S)
    parts = ([f"root cause: rank {root.group(1)}"] if root else []) + [first[r] for r in sorted(first, key=int)]
    return "; ".join(parts) or None


def scaling_efficiency(tokens_per_s_n: float, nproc: int, tokens_per_s_1: float) -> float:
    """Tokens/s of the N-GPU run ÷ (N × tokens/s of the one-GPU run): 1.0 is perfect scaling."""
    return tokens_per_s_n / (nproc * tokens_per_s_1)


def adapter_mismatches(adapters: dict, group=None) -> list[str]:
    """Names of the adapter tensors that differ bitwise from rank 0's (every rank gets the same list)."""
    import torch
    import torch.distributed as dist
    world = dist.get_world_size(group)
    differ = []
    for name in sorted(adapters):
        t = adapters[name].detach().contiguous()
        gathered = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(gathered, t, group=group)
        if any(not torch.equal(gathered[0], g) for g in gathered[1:]):
            differ.append(name)
    return differ


def rank_rows(batch: dict, rank: int, world: int) -> dict:
    """Rank ``rank``'s share of a global batch: its contiguous block of B/N rows (B must divide by N)."""
    rows = batch["input_ids"].shape[0]
    if rows % world:
        raise ValueError(f"the global batch has {rows} rows, not divisible by {world} ranks: set data.batch_size "
                         f"to a multiple of the number of GPUs")
    per = rows // world
    return {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}


# ------------------------------------------------------------------------------------------- the worker
def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lora_suite.config import load_tier_config
    from lora_suite.gradients import perturb_lora_a
    from lora_suite.prepare import prepare
    from lora_suite.trainer import train

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=60),
                            **({"device_id": device} if cuda else {}))
    try:
        cfg = load_tier_config(args.config)
        if args.implementation:
            cfg = dataclasses.replace(cfg, implementation=args.implementation)
        if args.steps:
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=args.steps))
        prepared = prepare(cfg, device)
        if args.perturb:  # the control run, as in the convergence tier
            perturb_lora_a(prepared.adapters, args.perturb)
        base = {n: p.detach().clone() for n, p in prepared.model.named_parameters() if not p.requires_grad}
        model = prepared.model
        if world > 1:
            model = DistributedDataParallel(model, device_ids=[local] if cuda else None)
        fail = args.mode == "fail"

        def batches(i: int):
            return rank_rows(prepared.batches(i), rank, world)

        def hook(step: int) -> None:
            if fail and rank == args.fail_rank and step + 1 == args.fail_at:
                raise RuntimeError(f"planted failure on rank {rank} at step {step + 1}")

        records = train(model, batches, cfg.train, adapters=prepared.adapters, step_hook=hook).records
        local_losses = torch.tensor([r.loss for r in records], dtype=torch.float64, device=device)
        dist.all_reduce(local_losses)
        differ = adapter_mismatches(prepared.adapters) if world > 1 else []
        untouched = all(torch.equal(p, base[n]) for n, p in prepared.model.named_parameters() if n in base)
        warm = min(len(records) // 4, 5)
        result = {
            "rank": rank, "world": world, "device": str(device), "implementation": cfg.implementation,
            "served_by": prepared.implementation.served_by(prepared.model),
            "losses": (local_losses / world).tolist(),
            "local_tokens_per_s": statistics.median(r.tokens_per_s for r in records[warm:]),
            "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
            "base_untouched": untouched, "adapters_differing_from_rank0": differ,
            "n_adapters": len(prepared.adapters),
        }
        if rank == 0:
            from safetensors.torch import save_file
            save_file({n: p.detach().cpu().contiguous() for n, p in prepared.adapters.items()},
                      str(Path(args.out) / "adapters.safetensors"))
        path = Path(args.out) / f"rank{rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(path)  # atomic: a reader never sees half a file
    except BaseException:
        # Leave at once, without destroy_process_group(): with NCCL it waits for the other ranks, which are blocked
        # in a collective this rank will never join, so the job hung until the NCCL timeout (seen on two H200s:
        # 200 s). Exiting lets torchrun see this rank fail and stop the others.
        for line in traceback.format_exc().splitlines():
            print(f"[rank{rank}]: {line}", file=sys.stderr)  # the prefix torchrun's own excepthook writes
        sys.stderr.flush()
        os._exit(1)
    # Done: the results are on disk. Leave without destroy_process_group(): on gloo it waited forever in one rank
    # once the other had exited (seen in CPU test runs); a barrier first, so no rank leaves while others still
    # gather from it.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one rank of a lora_suite multi-GPU run (started by torchrun)")
    ap.add_argument("--config", required=True, help="a tier YAML (configs/multigpu.yaml)")
    ap.add_argument("--out", required=True, help="directory for rank<r>.json and adapters.safetensors")
    ap.add_argument("--mode", choices=MODES, default="ddp")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--implementation", default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--perturb", type=float, default=0.0)
    ap.add_argument("--fail-rank", type=int, default=1)
    ap.add_argument("--fail-at", type=int, default=3)
    _worker(ap.parse_args(argv))


if __name__ == "__main__":
    main()
