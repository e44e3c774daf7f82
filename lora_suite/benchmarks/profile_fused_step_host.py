"""Where the host time of a fused-table eager step goes, by cProfile (issue 47: the eager steps of cupy-fused +
Liger at SmolLM2 and Llama-2-7B wait on their host for a fifth to a half of their span).

Usage on a GPU machine: ``python3 lora_suite/benchmarks/profile_fused_step_host.py [--case NAME] [--stack NAME]
[--steps 5] [--top 40]``. Builds the case and stack as the fused table does (``scenarios.fused_table``), runs 3
warm-up steps, then profiles ``--steps`` eager steps (forward, backward, optimizer step) and prints the host time
per step and the top functions by own time and by cumulative time; no assertions.
"""

from __future__ import annotations

import argparse
import pstats

import torch


def main() -> None:
    from lora_suite.implementations import resolve_implementation
    from lora_suite.measure.host_profile import profile_host
    from lora_suite.scenarios import fused_table as FT
    from lora_suite.scenarios import step_profile as SP

    cases = {c.name: c for c in FT.EAGER_CASES}
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", default="smollm2-all-r16-32x1024", choices=sorted(cases))
    parser.add_argument("--stack", default="cupy-fused+liger", choices=sorted(FT.STACKS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    case = cases[args.case]
    resolve_implementation(FT.STACKS[args.stack][0]).preload()
    cfg = FT.stack_config(case, args.stack, "eager", warmup=3, measured=args.steps)
    with FT.stack_model(cfg, args.stack) as (prepared, _window):
        step = SP.eager_step(prepared, cfg)
        per_step, prof = profile_host(step, warmup=3, iters=args.steps, sync=torch.cuda.synchronize)
        wall = per_step * 1e3
    print(f"{args.case} {args.stack}: {wall:.1f} ms per eager step (wall), profiled over {args.steps} steps below")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
