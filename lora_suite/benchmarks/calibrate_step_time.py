"""Calibrate the extended tier's batch size for its step-time criteria: host time vs GPU time per step.

The step-time criteria judge the GPU (CUDA-event time of each step). An eager step is host-bound when the
GPU finishes its work before the host has issued the next launch; then the event time follows host jitter
(a loaded host, another job). For each batch size this runs the extended configuration for --steps steps
and reports median host and GPU step time, the robust spread and the median drift of the GPU time after
warm-up, and peak memory. Run it under load (scripts/with-load.sh) to see which size stays GPU-bound.

    PYTHONPATH=. python3 benchmarks/calibrate_step_time.py --batch 4,8,16 --steps 120 --out reports/<run-id>
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import statistics

import torch

from lora_suite.engine.prepare import prepare
from lora_suite.engine.trainer import train
from lora_suite.harness.report import RunReport, Series
from lora_suite.implementations import implementation_record, resolve_implementation
from lora_suite.measure.criteria import median_drift, robust_spread
from lora_suite.settings.config import TierConfig
from lora_suite.settings.environment import collect_environment
from lora_suite.settings.loader import load_tier_config

COLUMNS = (  # the table of the report, one row per batch size
    "batch",
    "host median ms",
    "GPU median ms",
    "GPU robust spread",
    "host robust spread",
    "GPU time rise, 2nd half vs 1st",
    "SE",
    "GPU max ms",
    "peak GiB",
)


def _parse_args() -> argparse.Namespace:
    """The command line: the batch sizes, steps per size, warm-up steps left out, the load note, output."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="4,8,16")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--note", default="", help="what else ran on the machine (recorded in the report)")
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def _step_time_row(batch: int, records: list) -> tuple:
    """One row (``COLUMNS``) from the steps after warm-up: median host and GPU step time (ms), their robust
    spreads, the GPU time's rise from the first half to the second (−drift of ``median_drift``, with its SE), the
    slowest GPU step, and the peak allocated memory (GiB) since the last reset."""
    gpu = [r.gpu_time_s * 1e3 for r in records]
    host = [r.step_time_s * 1e3 for r in records]
    window = len(gpu) // 2
    drift = median_drift(gpu, window)
    return (
        batch,
        statistics.median(host),
        statistics.median(gpu),
        robust_spread(gpu),
        robust_spread(host),
        -drift.drift,
        drift.noise_se,
        max(gpu),
        torch.cuda.max_memory_allocated() / 2**30,
    )


def _calibrate_batch(base: TierConfig, batch: int, args: argparse.Namespace) -> tuple:
    """Train the extended config at one batch size on the GPU, print its row, free the GPU memory it held;
    returns the row."""
    cfg = dataclasses.replace(
        base,
        data=dataclasses.replace(base.data, batch_size=batch),
        train=dataclasses.replace(base.train, steps=args.steps),
        criteria=dataclasses.replace(base.criteria, smooth_slack=None),  # no smoothed-loss windows in a short run
    )
    torch.cuda.reset_peak_memory_stats()
    p = prepare(cfg, "cuda")
    records = train(p.model, p.batches, cfg.train).records[args.warmup :]
    row = _step_time_row(batch, records)
    print(
        f"batch {batch}: host {row[1]:.1f} ms, gpu {row[2]:.1f} ms, spread gpu {row[3]:.4f} "
        f"host {row[4]:.4f}, gpu-time rise {row[5]:+.4f} (SE {row[6]:.4f}), "
        f"max {row[7]:.1f} ms, peak {row[8]:.2f} GiB",
        flush=True,
    )
    del p
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    """Run every batch size and write the report: one table, a row per batch size."""
    args = _parse_args()
    base = load_tier_config("extended")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    report = RunReport(
        f"{stamp}-calibrate-step-time",
        "calibration of the extended tier's batch size",
        collect_environment(),
        status="complete",
    )
    report.implementation = implementation_record(resolve_implementation("cupy"))
    report.notes.append(
        f"extended config, {args.steps} steps per batch size, statistics after step {args.warmup}; "
        f"load: {args.note or 'none'}; weights={base.weights} (random init unless a checkpoint is cached)"
    )
    rows = [_calibrate_batch(base, batch, args) for batch in (int(b) for b in args.batch.split(","))]
    report.add_series(Series("calibrate_step_time", "step time by batch size (after warm-up)", COLUMNS, tuple(rows)))
    print(report.write(args.out))


if __name__ == "__main__":
    main()
