"""Synthetic nights for the history page's scale target (issue 45): ``rows(n_runs)`` builds the ledger rows of ``n_runs``
runs spread over 3 GPUs, 4 implementations and 5 tiers, a dozen figures each, with a few failures (``run_rows``: one
run's rows; ``fleet``: a few nights of three GPU types, as the nightly over a fleet records them); ``python -m
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
        checks = {f"check {c}": 1 + 0.05 * rnd.random() + (0.3 if rnd.random() < 0.002 else 0.0) for c in range(CHECKS)}
        out += run_rows(
            f"{stamp}-{tier}-{i}", gpu, impl, tier, checks, {"step ms": 50 + rnd.random()}, commit=f"{i:07x}"
        )
    return out


def run_rows(
    run_id: str,
    gpu: str,
    impl: str,
    tier: str,
    checks: dict[str, float],
    figures: dict[str, float] | None = None,
    *,
    group: str = "synthetic",
    commit: str = "0000000",
    bound: float = 1.2,
) -> list[dict]:
    """One run's ledger rows: its run row, each of ``checks`` as a check under ``<= bound`` (failed above it), each of
    ``figures`` as a measured figure. ``run_id`` starts with the run's UTC stamp (``20260301T021700Z-quick``)."""
    base: dict[str, object] = {
        "run_id": run_id,
        "time": "",
        "group": group,
        "commit": commit,
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
    out = [{**base, "kind": "run", "check": "run", "value": None, "verdict": "None"}]
    for name, v in checks.items():
        verdict = "pass" if v <= bound else "fail"
        out.append({**base, "kind": "check", "check": name, "value": v, "op": "<=", "threshold": bound,
                    "verdict": verdict})  # fmt: skip
    for name, v in (figures or {}).items():
        out.append({**base, "kind": "figure", "check": name, "value": v, "verdict": "measured"})
    return out


def fleet(nights: int = 3) -> list[dict]:
    """A fleet's nights, as the nightly records them (each GPU type under its own group, ``nightly-<n>-<gpu>``; the
    types start together, so their runs share run ids): ``nights`` nights of quick and memory on each of ``GPUS``
    with cupy, except that the A100 never ran memory. Night ``n`` (from 1) of GPU number ``k`` has ``check 0`` =
    ``1 + n / 100 + k / 1000`` and ``step ms`` = ``50 + 10 * k + n``; the H200's last quick night fails ``check 1``."""
    out = []
    for n in range(1, nights + 1):
        stamp = f"202603{n:02d}T021700Z"
        for k, gpu in enumerate(GPUS):
            for tier in ("quick", "memory"):
                if tier == "memory" and "A100" in gpu:
                    continue
                failing = n == nights and tier == "quick" and gpu == "NVIDIA H200"
                checks = {"check 0": 1 + n / 100 + k / 1000, "check 1": 1.5 if failing else 1.0}
                group = f"nightly-{n}-{gpu.split()[1].split('-')[0].lower()}"  # nightly-1-h100
                out += run_rows(f"{stamp}-{tier}", gpu, "cupy", tier, checks, {"step ms": 50.0 + 10 * k + n},
                                group=group, commit=f"{n:07x}")  # fmt: skip
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
