"""Synthetic nights for the history page's scale target (issue 45): ``rows(n_runs)`` builds the ledger rows of ``n_runs``
runs spread over 3 GPUs, 4 implementations and 5 tiers, a dozen figures each, with a few failures; ``python -m
lora_suite.results.synthetic_history [N] [OUT.html]`` times the page's generation from them (reading, grouping, the
compare rule between consecutive runs, rendering, writing) and prints the time and the page's size. The target, on
a CPU-only machine: 10,000 runs in at most 5 s, a page of at most 10 MB."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

GPUS = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB")
IMPLS = ("cupy", "cupy-fused", "peft", "unsloth")
TIERS = ("quick", "convergence", "memory", "extended", "full")
CHECKS = 10


def rows(n_runs: int = 10_000, seed: int = 0) -> list[dict]:
    """Ledger rows (``ledger.FIELDS``) of ``n_runs`` runs, 20 a day: a run row, ``CHECKS`` checks under a bound
    (about one in 500 over it), and one device-clocked figure each."""
    rnd = random.Random(seed)
    out = []
    for i in range(n_runs):
        day = i // 20
        stamp = f"2026{1 + (day // 28) % 12:02d}{1 + day % 28:02d}T{i % 20:02d}{(day // 336) % 60:02d}00Z"
        gpu, impl, tier = rnd.choice(GPUS), rnd.choice(IMPLS), rnd.choice(TIERS)
        base: dict[str, object] = {
            "run_id": f"{stamp}-{tier}-{i}",
            "time": "",
            "group": "synthetic",
            "commit": f"{i:07x}",
            "gpu": gpu,
            "driver": "",
            "cuda": "",
            "torch": "",
            "implementation": impl,
            "tier": tier,
            "op": "",
            "threshold": None,
            "unit": "",
            "source": "synthetic",
            "detail": "",
        }
        out.append({**base, "kind": "run", "check": "run", "value": None, "verdict": "None"})
        for c in range(CHECKS):
            v = 1 + 0.05 * rnd.random() + (0.3 if rnd.random() < 0.002 else 0.0)
            verdict = "pass" if v <= 1.2 else "fail"
            out.append({**base, "kind": "check", "check": f"check {c}", "value": v, "op": "<=", "threshold": 1.2,
                        "verdict": verdict})  # fmt: skip
        out.append({**base, "kind": "figure", "check": "step ms", "value": 50 + rnd.random(), "verdict": "measured"})
    return out


def main(argv: list[str]) -> int:
    from lora_suite.results import history

    n = int(argv[0]) if argv else 10_000
    out = Path(argv[1]) if len(argv) > 1 else Path("reports") / "history-synthetic" / "history.html"
    data = rows(n)
    start = time.perf_counter()
    history.write(out, history.collect_rows(data))
    took = time.perf_counter() - start
    print(
        f"history of {n} synthetic runs ({len(data)} rows): {took:.2f} s, page {out.stat().st_size / 1e6:.2f} MB: {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
