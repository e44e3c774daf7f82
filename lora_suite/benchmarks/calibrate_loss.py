"""Calibrate a tier's training setup: loss drop over a grid of targets / rank / lr / data pool.

The tiers' loss thresholds are fixed by their issues (e.g. a 30% drop); what is calibrated is the setup
(adapter targets, learning rate, data) that a correct LoRA stack can be expected to move that much on a
random-initialised base. This script runs the grid on the GPU with the tier's own code (prepare.prepare +
trainer.train, cupy backend) and writes report.json / report.md, which the tier YAML cites.

    PYTHONPATH=. python3 benchmarks/calibrate_loss.py --tier convergence --targets "q_proj,v_proj;all-linear" \
        --lr 2e-3,5e-3 --pool 0,8 --out reports/<run-id>
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import itertools
import statistics
from collections.abc import Iterator

import torch

from lora_suite.engine.prepare import prepare
from lora_suite.engine.trainer import train
from lora_suite.harness.report import RunReport, Series
from lora_suite.implementations import implementation_record, resolve_implementation
from lora_suite.measure.criteria import loss_drop
from lora_suite.settings.config import TierConfig
from lora_suite.settings.environment import collect_environment
from lora_suite.settings.loader import load_tier_config


def _parse_args() -> argparse.Namespace:
    """The command line: the tier, the grid's axes (each defaulting to the tier's own setting), steps, output."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tier", required=True)
    ap.add_argument("--targets", default=None, help="';'-separated target lists, each ','-separated")
    ap.add_argument("--r", default=None, help="comma-separated ranks")
    ap.add_argument("--lr", default=None, help="comma-separated learning rates")
    ap.add_argument("--pool", default=None, help="comma-separated data pool sizes (0: fresh windows)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def _grid(args: argparse.Namespace, cfg: TierConfig) -> Iterator[tuple]:
    """The grid's points (targets, r, lr, pool): the product of the axes given, the tier's value on each other."""
    return itertools.product(
        [tuple(t.split(",")) for t in args.targets.split(";")] if args.targets else [cfg.lora.targets],
        [int(x) for x in args.r.split(",")] if args.r else [cfg.lora.r],
        [float(x) for x in args.lr.split(",")] if args.lr else [cfg.train.lr],
        [int(x) for x in args.pool.split(",")] if args.pool else [cfg.data.pool],
    )


def _point_config(cfg: TierConfig, targets: tuple, r: int, lr: float, pool: int, steps: int) -> TierConfig:
    """The tier's config at one grid point, on the cupy implementation: alpha = 2r, warm-up at most a tenth of
    the steps."""
    return dataclasses.replace(
        cfg,
        implementation="cupy",
        lora=dataclasses.replace(cfg.lora, targets=targets, r=r, alpha=2 * r),
        data=dataclasses.replace(cfg.data, pool=pool),
        train=dataclasses.replace(cfg.train, lr=lr, steps=steps, warmup_steps=min(cfg.train.warmup_steps, steps // 10)),
    )


def _calibration_row(point: tuple, steps: int, res, w: int) -> tuple:
    """One row of the grid table: the point, the mean loss of the first and of the last ``w`` steps, the drop
    (first − last) / first, and the median step time in ms (the first step left out)."""
    targets, r, lr, pool = point
    losses = res.losses
    return (
        "+".join(targets),
        r,
        lr,
        pool,
        steps,
        statistics.fmean(losses[:w]),
        statistics.fmean(losses[-w:]),
        loss_drop(losses, w),
        1e3 * statistics.median(x.step_time_s for x in res.records[1:]),
    )


def _calibrate_point(report: RunReport, tier: str, cfg: TierConfig, point: tuple, steps: int) -> tuple:
    """Train one grid point on the GPU, print its row and add its loss curve to ``report``, then free the GPU
    memory it held; returns the row."""
    targets, r, lr, pool = point
    c = _point_config(cfg, targets, r, lr, pool, steps)
    p = prepare(c, "cuda")
    res = train(p.model, p.batches, c.train)
    row = _calibration_row(point, steps, res, cfg.criteria.loss_window)
    print(" ".join(str(round(v, 4)) if isinstance(v, float) else str(v) for v in row), flush=True)
    report.add_series(
        Series(
            f"{tier}",
            f"loss, {row[0]} r{r} lr{lr} pool{pool}",
            ("step", "loss"),
            tuple((x.step, x.loss) for x in res.records),
            plot_x="step",
            plot_y=("loss",),
        )
    )
    del p, res
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    """Run the calibration grid and write its report (the grid table first, then each point's loss curve)."""
    args = _parse_args()
    cfg = load_tier_config(args.tier)
    steps = args.steps or cfg.train.steps
    grid = _grid(args, cfg)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    report = RunReport(
        f"{stamp}-calibrate-{args.tier}", f"calibration of the {args.tier} tier setup", collect_environment()
    )
    report.implementation = implementation_record(resolve_implementation("cupy"))
    rows = [_calibrate_point(report, args.tier, cfg, point, steps) for point in grid]
    report.notes.append(
        f"base config {cfg.source}; weights {cfg.weights}; loss drop = (mean of first {cfg.criteria.loss_window}"
        f" steps - mean of last {cfg.criteria.loss_window}) / first"
    )
    report.series.insert(
        0,
        Series(
            args.tier,
            "calibration grid",
            ("targets", "r", "lr", "pool", "steps", "first window", "last window", "drop", "ms/step"),
            tuple(rows),
        ),
    )
    print(report.write(args.out))


if __name__ == "__main__":
    main()
