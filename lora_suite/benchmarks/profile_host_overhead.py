"""Where the host time of one LoRA forward+backward goes (launch-bound case), by cProfile.

Usage on a GPU machine: ``python3 benchmarks/profile_host_overhead.py [--backend cupy] [--iters 500]``.
Prints the mean wall time per call and the top functions by own time; no timing assertions.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import lora_core


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

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        step()
    torch.cuda.synchronize()
    print(f"{args.backend}: {(time.perf_counter() - t0) / args.iters * 1e6:.1f} us per forward+backward (host-bound)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.iters):
        step()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
