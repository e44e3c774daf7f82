"""Where the host time of one LoRA forward+backward goes (launch-bound case), by cProfile.

Usage on a GPU machine: ``python3 benchmarks/profile_host_overhead.py [--backend cupy] [--iters 500]``.
Prints the mean wall time per call and the top functions by own time; no timing assertions.
"""

from __future__ import annotations

import argparse
import pstats

import torch

import lora_core
from lora_suite.measure.host_profile import profile_host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="cupy", choices=lora_core.BACKENDS)
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    layer = lora_core.LoRALinear.from_linear(
        torch.nn.Linear(64, 64, bias=False, device="cuda", dtype=torch.bfloat16),
        r=8,
        backend=args.backend,
        adapter_dtype=torch.bfloat16,
    )
    x = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    params = (x, layer.lora_A, layer.lora_B)

    def step():
        return torch.autograd.grad(layer(x), params, dy)

    per_call, prof = profile_host(step, warmup=20, iters=args.iters, sync=torch.cuda.synchronize)
    print(f"{args.backend}: {per_call * 1e6:.1f} us per forward+backward (host-bound)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
