"""A neighbour on the same GPU that holds memory and keeps taking and freeing more, as another tenant does (a second
CI job, a notebook, an MPS client): ``python -m lora_suite.scenarios.memory_churn [--hold-gib H] [--churn-gib C]
[--period-s P] [--seconds S]``.

It allocates ``H`` GiB once and keeps it, then, every ``P`` seconds, allocates a chunk of 0.25 to ``C`` GiB (sizes
from a fixed-seed generator), writes it, runs a few bf16 matmuls, frees it and returns it to the driver
(``torch.cuda.empty_cache``), so that NVML's device-wide used memory swings by gigabytes. Every
``--report-every`` seconds it prints the device-wide used memory it saw (min / max), which shows that the neighbour
did move it. It never reads or judges anything of the suite; scripts/sharing-acceptance.sh runs it beside the
planted leaks of selftest-gpu (issue 28: a verdict on this process's memory must still catch them).
"""

from __future__ import annotations

import argparse
import random
import time


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lora_suite.scenarios.memory_churn", description=__doc__.split("\n")[0])
    p.add_argument("--hold-gib", type=float, default=6.0, help="memory held for the whole run (default 6)")
    p.add_argument("--churn-gib", type=float, default=4.0, help="largest chunk taken and freed (default 4)")
    p.add_argument("--period-s", type=float, default=0.1, help="seconds between chunks (default 0.1)")
    p.add_argument("--seconds", type=float, default=0.0, help="stop after this long (default 0: until killed)")
    p.add_argument("--report-every", type=float, default=30.0, help="seconds between printed readings")
    args = p.parse_args(argv)
    for name in ("hold_gib", "churn_gib", "period_s"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.churn_gib < 0.25:
        p.error(f"--churn-gib must be >= 0.25 (the smallest chunk), got {args.churn_gib}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    from lora_suite.measure.memory import GIB as gib
    from lora_suite.measure.nvml import NvmlReader

    if not torch.cuda.is_available():
        print("memory_churn: no CUDA GPU: nothing to churn")
        return 2
    held = torch.empty(int(args.hold_gib * gib), dtype=torch.uint8, device="cuda")  # kept for the whole run
    held.fill_(1)
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    rng, reader = random.Random(28), NvmlReader()
    seen: list[int] = []
    start = last = time.monotonic()
    chunks = 0
    try:
        while not args.seconds or time.monotonic() - start < args.seconds:
            size = int(rng.uniform(0.25, args.churn_gib) * gib)
            chunk = torch.empty(size, dtype=torch.uint8, device="cuda")
            chunk.fill_(2)
            for _ in range(4):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
            used = reader.used()
            if used is not None:
                seen.append(used)
            del chunk
            torch.cuda.empty_cache()
            chunks += 1
            time.sleep(args.period_s)
            if time.monotonic() - last >= args.report_every and seen:
                print(
                    f"memory_churn: {chunks} chunks; device-wide used {min(seen) / gib:.2f}-{max(seen) / gib:.2f} "
                    f"GiB (holding {args.hold_gib} GiB, chunks up to {args.churn_gib} GiB)",
                    flush=True,
                )
                seen, last = [], time.monotonic()
    except KeyboardInterrupt:
        pass
    finally:
        reader.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
