"""One rank of a multigpu or multinode job, as torchrun starts it (``python -m lora_suite.scenarios.multigpu_worker``):
train with DDP or FSDP2 (or fail on purpose, mode ``fail``) and write this rank's figures as JSON;
``lora_suite.scenarios.multigpu`` and ``multinode`` launch it and hold the verdicts' arithmetic."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from lora_suite.scenarios.multigpu import (
    MODES,
    adapter_mismatches,
    base_checksums,
    memory_terms,
    rank_rows,
    shard_model,
)
from lora_suite.scenarios.multinode_checks import write_json_atomically


@dataclasses.dataclass(frozen=True)
class _Rank:
    """Where this process stands in the job: its global rank, the world size, its local rank (the GPU index on
    its host) and the device it trains on."""

    rank: int
    world: int
    local: int
    device: Any  # a torch.device

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def _join_process_group(args: argparse.Namespace) -> _Rank:
    """Read this rank's place from torchrun's environment, bind its GPU and join the process group: NCCL on CUDA,
    gloo on the CPU, a 60 s timeout on every collective."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    timeout = datetime.timedelta(seconds=60)
    if cuda:
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return _Rank(rank, world, local, device)


def _overridden(cfg, args: argparse.Namespace):
    """The tier configuration with the command line's overrides: the implementation (and what it declares it cannot
    run changed as every tier changes it, ``fit_to_implementation``), the number of steps and the global batch size
    (the data pool grown to hold at least one batch)."""
    if args.implementation:
        from lora_suite.engine.prepare import fit_to_implementation
        from lora_suite.implementations.lookup import resolve_implementation

        cfg = dataclasses.replace(cfg, implementation=args.implementation)
        cfg = fit_to_implementation(cfg, resolve_implementation(args.implementation), str(args.config))[0]
    if args.steps:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=args.steps))
    if args.batch_size:
        cfg = dataclasses.replace(
            cfg,
            data=dataclasses.replace(cfg.data, batch_size=args.batch_size, pool=max(cfg.data.pool, args.batch_size)),
        )
    return cfg


def _base_snapshot(model, fsdp: bool):
    """What the untouched-base check compares against after training: the frozen weights' checksums under FSDP (a
    full copy would be the model again on every rank), else a copy of every frozen parameter, by name."""
    if fsdp:
        return base_checksums(model)
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def _parallelize(model, adapters: dict, args: argparse.Namespace, me: _Rank) -> tuple:
    """The model and adapters each rank trains: sharded by FSDP2 (mode fsdp, more than one rank; the adapters
    become the DTensor parameters ``fully_shard`` put in the modules' place), wrapped in DDP (the other modes, more
    than one rank, unless ``--plant-no-sync``), or as prepared."""
    from torch.nn.parallel import DistributedDataParallel

    if args.mode == "fsdp" and me.world > 1:
        from lora_core.inject import adapter_parameters

        shard_model(model, reshard_after_forward=not args.plant_no_reshard)
        adapters = adapter_parameters(model)  # the DTensor parameters fully_shard put in the modules' place
    elif me.world > 1 and not args.plant_no_sync:  # planted: no DDP, so each rank keeps its own gradients
        model = DistributedDataParallel(model, device_ids=[me.local] if me.cuda else None)
    return model, adapters


def _planted_failure(args: argparse.Namespace, rank: int) -> Callable[[int], None]:
    """The step hook: in mode ``fail``, rank ``--fail-rank`` raises at step ``--fail-at`` (counted from 1); every
    other rank, step and mode trains on."""
    fail = args.mode == "fail"

    def hook(step: int) -> None:
        if fail and rank == args.fail_rank and step + 1 == args.fail_at:
            raise RuntimeError(f"planted failure on rank {rank} at step {step + 1}")

    return hook


def _global_losses(records: list, me: _Rank) -> list[float]:
    """The global loss of every step, the mean of the ranks' local losses: L_t = (1/N) Σ_r L_t^r (all-reduced in
    float64; a collective every rank joins)."""
    import torch
    import torch.distributed as dist

    local_losses = torch.tensor([r.loss for r in records], dtype=torch.float64, device=me.device)
    dist.all_reduce(local_losses)
    return (local_losses / me.world).tolist()


def _rank_result(args: argparse.Namespace, cfg, prepared, records: list, peak: int | None, n_adapters: int, me: _Rank):
    """This rank's figures common to every mode: the global losses, the median local tokens/s past the warm-up
    steps (a quarter of the run, at most 5) and the peak memory of training."""
    losses = _global_losses(records, me)
    warm = min(len(records) // 4, 5)
    return {
        "rank": me.rank,
        "world": me.world,
        "mode": args.mode,
        "device": str(me.device),
        "implementation": cfg.implementation,
        "served_by": prepared.implementation.served_by(prepared.model),
        "losses": losses,
        "batch_size": cfg.data.batch_size,
        "local_tokens_per_s": statistics.median(r.tokens_per_s for r in records[warm:]),
        "peak_allocated_gib": peak / 2**30 if peak is not None else None,
        "peak_allocated_bytes": peak,
        "n_adapters": n_adapters,
    }


def _fsdp_checks(
    result: dict, model, prepared, terms: dict[str, int], base_before, args: argparse.Namespace, me: _Rank
) -> None:
    """Mode fsdp's figures and outputs: the memory terms, the base checked by checksums, and (every rank taking
    part) the adapters saved as a PEFT folder and the probe batch's logits, both written by rank 0."""
    result["memory_terms"] = terms
    result["sharded"] = me.world > 1
    result["base_untouched"] = base_checksums(model) == base_before
    result["adapters_differing_from_rank0"] = None  # sharded: each rank holds its own part
    _save_fsdp_outputs(model, prepared, args, me)


def _save_fsdp_outputs(model, prepared, args: argparse.Namespace, me: _Rank) -> None:
    """Save the sharded adapters as a PEFT folder (``<out>/adapter``) and the logits of a forward pass over one
    probe window (``<out>/probe.safetensors``), both gathered by every rank and written by rank 0."""
    import torch
    from safetensors.torch import save_file

    from lora_core.adapters import save_peft_adapter

    save_peft_adapter(model, Path(args.out) / "adapter", write=me.rank == 0)
    probe = prepared.batches(10_000)["input_ids"][:1]  # the same window on every rank
    with torch.no_grad():
        logits = model(input_ids=probe).logits.float()
    if me.rank == 0:
        save_file(
            {"input_ids": probe.cpu().contiguous(), "logits": logits.cpu().contiguous()},
            str(Path(args.out) / "probe.safetensors"),
        )


def _replica_checks(result: dict, adapters: dict, prepared, base: dict, args: argparse.Namespace, me: _Rank) -> None:
    """The replicated modes' figures and outputs: the adapter tensors that differ from rank 0's (bitwise,
    all-gathered), the frozen base compared bitwise with its copy, and rank 0's adapters saved for the comparison
    with the one-GPU run (``<out>/adapters.safetensors``)."""
    import torch

    result["adapters_differing_from_rank0"] = adapter_mismatches(adapters) if me.world > 1 else []
    result["base_untouched"] = all(
        torch.equal(p, base[n]) for n, p in prepared.model.named_parameters() if n in base
    )  # the unwrapped model: DDP's names carry "module."
    if me.rank == 0:
        from safetensors.torch import save_file

        save_file(
            {n: p.detach().cpu().contiguous() for n, p in adapters.items()},
            str(Path(args.out) / "adapters.safetensors"),
        )


def _exit_failed(rank: int) -> NoReturn:
    """Print the exception's traceback with torchrun's ``[rank<r>]:`` prefix and leave at once with status 1."""
    # Leave at once, without destroy_process_group(): with NCCL it waits for the other ranks, which are blocked
    # in a collective this rank will never join, so the job hung until the NCCL timeout (seen on two H200s:
    # 200 s). Exiting lets torchrun see this rank fail and stop the others.
    for line in traceback.format_exc().splitlines():
        print(f"[rank{rank}]: {line}", file=sys.stderr)  # the prefix torchrun's own excepthook writes
    sys.stderr.flush()
    os._exit(1)


def _exit_done() -> NoReturn:
    """Leave with status 0 once every rank has its results on disk."""
    import torch.distributed as dist

    # Done: the results are on disk. Leave without destroy_process_group(): on gloo it waited forever in one rank
    # once the other had exited (seen in CPU test runs); a barrier first, so no rank leaves while others still
    # gather from it.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _step_hook(args: argparse.Namespace, me: _Rank) -> Callable[[int], None]:
    """Every hook a step of this rank runs: the planted failure, and in a multinode job (``--node``) the heartbeat
    and the planted node loss (``lora_suite.scenarios.multinode_checks``)."""
    hooks = [_planted_failure(args, me.rank)]
    if args.node is not None:
        from lora_suite.scenarios.multinode_checks import Heartbeat, stop_node_hook

        hooks += [Heartbeat(args.out, me.rank, args.node, me.local), stop_node_hook(args.node, me.local, *args.stop)]

    def hook(step: int) -> None:
        for h in hooks:
            h(step)

    return hook


def _train(model, adapters: dict, prepared, cfg, args: argparse.Namespace, me: _Rank) -> tuple[list, dict]:
    """This rank's training: the step records, and the DCP round trip's figures when ``--dcp-at`` asks for it
    (``lora_suite.scenarios.dcp_round_trip``)."""
    from lora_suite.engine.trainer import train

    def batches(i: int) -> dict:
        return rank_rows(prepared.batches(i), me.rank, me.world)

    hook = _step_hook(args, me)
    if args.dcp_at is None:
        return train(model, batches, cfg.train, adapters=adapters, step_hook=hook).records, {}
    from lora_suite.scenarios.dcp_round_trip import train_with_round_trip

    records, trip = train_with_round_trip(
        model,
        batches,
        cfg.train,
        adapters,
        args.dcp_at,
        Path(args.out) / "dcp",
        step_hook=hook,
        plant_no_optimizer=args.plant_dcp_no_optimizer,
    )
    return records, {"dcp_round_trip": trip.as_dict()}


def _worker(args: argparse.Namespace) -> None:
    """Train this rank's share of the run in the mode ``args.mode`` and write its figures to ``<out>/rank<r>.json``;
    the process ends here (``os._exit``), with status 1 on any exception."""
    import torch

    from lora_suite.engine.gradients import perturb_lora_a
    from lora_suite.engine.prepare import prepare
    from lora_suite.settings.loader import load_tier_config

    me = _join_process_group(args)
    try:
        cfg = _overridden(load_tier_config(args.config), args)
        prepared = prepare(cfg, me.device)
        if args.perturb:  # the control run, as in the convergence tier
            perturb_lora_a(prepared.adapters, args.perturb)
        model, adapters = prepared.model, prepared.adapters
        fsdp = args.mode == "fsdp"
        terms = memory_terms(model, adapters) if fsdp else None
        base = _base_snapshot(model, fsdp)
        model, adapters = _parallelize(model, adapters, args, me)
        if me.cuda:
            torch.cuda.reset_peak_memory_stats(me.device)  # the peak of training: the model is built and sharded
        records, extra = _train(model, adapters, prepared, cfg, args, me)
        peak = torch.cuda.max_memory_allocated(me.device) if me.cuda else None
        result = {**_rank_result(args, cfg, prepared, records, peak, len(adapters), me), **extra}
        if fsdp:
            assert terms is not None  # measured above, before the model was sharded
            _fsdp_checks(result, model, prepared, terms, base, args, me)
        else:
            _replica_checks(result, adapters, prepared, base, args, me)
        if args.node is not None:  # a multinode job
            from lora_suite.scenarios.multinode_checks import record_job

            record_job(result, adapters, args.out, args.node)
        write_json_atomically(Path(args.out) / f"rank{me.rank}.json", result)
    except BaseException:
        _exit_failed(me.rank)
    _exit_done()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one rank of a lora_suite multi-GPU run (started by torchrun)")
    ap.add_argument("--config", required=True, help="a tier YAML (configs/multigpu.yaml)")
    ap.add_argument("--out", required=True, help="directory for rank<r>.json and adapters.safetensors")
    ap.add_argument("--mode", choices=MODES, default="ddp")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--implementation", default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None, help="override data.batch_size (the global batch)")
    ap.add_argument(
        "--plant-no-sync",
        action="store_true",
        help="ddp: train without DDP, gradients never averaged (the planted defect of the rank check)",
    )
    ap.add_argument(
        "--plant-no-reshard",
        action="store_true",
        help="fsdp: keep layers gathered after forward (the planted defect of the memory check)",
    )
    ap.add_argument("--perturb", type=float, default=0.0)
    ap.add_argument("--fail-rank", type=int, default=1)
    ap.add_argument("--fail-at", type=int, default=3)
    ap.add_argument(
        "--node-index", dest="node", type=int, default=None, help="multinode: this node's index (heartbeats, job.json)"
    )
    ap.add_argument(
        "--stop", type=int, nargs=2, default=(None, None), metavar=("NODE", "STEP"), help="plant: node loss"
    )
    ap.add_argument("--dcp-at", type=int, default=None, help="the DCP round trip: checkpoint after step K - 1")
    ap.add_argument(
        "--plant-dcp-no-optimizer",
        action="store_true",
        help="the DCP round trip loads the adapters alone (the planted defect of the round-trip check)",
    )
    _worker(ap.parse_args(argv))


if __name__ == "__main__":
    main()
