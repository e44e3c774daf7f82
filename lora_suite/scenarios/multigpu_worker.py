"""One rank of a multigpu tier job, as torchrun starts it (``python -m lora_suite.scenarios.multigpu_worker``):
train the configured model with DDP or FSDP2 (or fail on purpose, mode ``fail``) and write this rank's figures
as JSON; ``lora_suite.scenarios.multigpu`` launches it and holds the verdicts' arithmetic."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import traceback
from pathlib import Path

from lora_suite.scenarios.multigpu import (
    MODES,
    adapter_mismatches,
    base_checksums,
    memory_terms,
    rank_rows,
    shard_model,
)


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lora_suite.core.loader import load_tier_config
    from lora_suite.engine.gradients import perturb_lora_a
    from lora_suite.engine.prepare import prepare
    from lora_suite.engine.trainer import train

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=60), **({"device_id": device} if cuda else {})
    )
    try:
        cfg = load_tier_config(args.config)
        if args.implementation:
            cfg = dataclasses.replace(cfg, implementation=args.implementation)
        if args.steps:
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=args.steps))
        if args.batch_size:
            cfg = dataclasses.replace(
                cfg,
                data=dataclasses.replace(
                    cfg.data, batch_size=args.batch_size, pool=max(cfg.data.pool, args.batch_size)
                ),
            )
        prepared = prepare(cfg, device)
        if args.perturb:  # the control run, as in the convergence tier
            perturb_lora_a(prepared.adapters, args.perturb)
        model, adapters = prepared.model, prepared.adapters
        fsdp = args.mode == "fsdp"
        terms = memory_terms(model, adapters) if fsdp else None
        if fsdp:
            base_before = base_checksums(model)
        else:
            base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        if fsdp and world > 1:
            from lora_core.inject import adapter_parameters

            shard_model(model, reshard_after_forward=not args.plant_no_reshard)
            adapters = adapter_parameters(model)  # the DTensor parameters fully_shard put in the modules' place
        elif world > 1 and not args.plant_no_sync:  # planted: no DDP, so each rank keeps its own gradients
            model = DistributedDataParallel(model, device_ids=[local] if cuda else None)
        fail = args.mode == "fail"

        def batches(i: int):
            return rank_rows(prepared.batches(i), rank, world)

        def hook(step: int) -> None:
            if fail and rank == args.fail_rank and step + 1 == args.fail_at:
                raise RuntimeError(f"planted failure on rank {rank} at step {step + 1}")

        if cuda:
            torch.cuda.reset_peak_memory_stats(device)  # the peak of training: the model is built and sharded
        records = train(model, batches, cfg.train, adapters=adapters, step_hook=hook).records
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        local_losses = torch.tensor([r.loss for r in records], dtype=torch.float64, device=device)
        dist.all_reduce(local_losses)
        warm = min(len(records) // 4, 5)
        result = {
            "rank": rank,
            "world": world,
            "mode": args.mode,
            "device": str(device),
            "implementation": cfg.implementation,
            "served_by": prepared.implementation.served_by(prepared.model),
            "losses": (local_losses / world).tolist(),
            "batch_size": cfg.data.batch_size,
            "local_tokens_per_s": statistics.median(r.tokens_per_s for r in records[warm:]),
            "peak_allocated_gib": peak / 2**30 if peak is not None else None,
            "peak_allocated_bytes": peak,
            "n_adapters": len(adapters),
        }
        if fsdp:
            from safetensors.torch import save_file

            from lora_core.adapters import save_peft_adapter

            result["memory_terms"] = terms
            result["sharded"] = world > 1
            result["base_untouched"] = base_checksums(model) == base_before
            result["adapters_differing_from_rank0"] = None  # sharded: each rank holds its own part
            save_peft_adapter(model, Path(args.out) / "adapter", write=rank == 0)
            probe = prepared.batches(10_000)["input_ids"][:1]  # the same window on every rank
            with torch.no_grad():
                logits = model(input_ids=probe).logits.float()
            if rank == 0:
                save_file(
                    {"input_ids": probe.cpu().contiguous(), "logits": logits.cpu().contiguous()},
                    str(Path(args.out) / "probe.safetensors"),
                )
        else:
            result["adapters_differing_from_rank0"] = adapter_mismatches(adapters) if world > 1 else []
            result["base_untouched"] = all(
                torch.equal(p, base[n]) for n, p in prepared.model.named_parameters() if n in base
            )  # the unwrapped model: DDP's names carry "module."
            if rank == 0:
                from safetensors.torch import save_file

                save_file(
                    {n: p.detach().cpu().contiguous() for n, p in adapters.items()},
                    str(Path(args.out) / "adapters.safetensors"),
                )
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
    _worker(ap.parse_args(argv))


if __name__ == "__main__":
    main()
