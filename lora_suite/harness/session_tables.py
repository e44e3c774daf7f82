"""The tables a run report gains when its session ends: the tier's wall time against its target, where the wall
time went, the RawKernel variants reached, and what an xdist worker hands over at its end.

``state`` is the plugin's record of the session (``plugin.state.SessionState``): its start times, clock, CUDA
context time, worker count and the workers' final outputs.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from lora_suite.harness import worker_records
from lora_suite.harness.figures import record_figure
from lora_suite.harness.report import RunReport, Series
from lora_suite.measure import wall_time
from lora_suite.settings import env_vars
from lora_suite.settings.config import CONFIG_DIR
from lora_suite.settings.loader import load_tier_config

if TYPE_CHECKING:
    from lora_suite.harness.plugin.state import SessionState


def tier_wall_time(run: RunReport, tier: str, elapsed: float) -> str | None:
    """Where ``configs/<tier>.yaml`` sets criteria.tier_seconds_target: the session's wall time against it, as a
    table and a summary line (returned), never a failed check: the host's load and the GPU's other tenants move a
    wall time as much as the code does, and a verdict must judge the code."""
    path = CONFIG_DIR / f"{tier}.yaml"
    if not tier or not path.exists():
        return None
    target = load_tier_config(path).criteria.tier_seconds_target
    if target is None:
        return None
    elapsed = round(elapsed, 1)
    met = elapsed <= target
    run.add_series(
        Series(
            "session",
            f"{tier} tier wall time against its target",
            ("figure", "seconds", "target", "met", "source"),
            ((f"whole {tier} tier wall time", elapsed, target, "yes" if met else "no", f"{path.name} criteria"),),
        )
    )
    if not any(f.name == "tier wall time" for f in run.figures):  # quick's headline figure, host-clocked: listed
        record_figure(run, "session", tier, "tier wall time", elapsed, missing_ok=True)
    return (
        f"{tier} tier wall time {elapsed} s, {'within' if met else 'MISSED:'} its {target:g} s target (a reported "
        "figure, not a check; the report's wall-time breakdown says where it went)"
    )


def wall_time_breakdown(run: RunReport, state: SessionState) -> None:
    """GPU runs: where the wall time went (lora_suite.measure.wall_time), as a series of the report."""
    workers = state.workers
    if state.cuda_context_s is None and not workers:
        return
    if state.session_start is None or state.configured is None or state.start is None:
        return  # the session never started
    interop = sys.modules.get("lora_core.ops.cupy_interop")
    loads = dict(getattr(interop, "KERNEL_LOAD_SECONDS", {}))
    for out in state.worker_outputs:
        for k, v in out.get("kernel_loads", {}).items():
            loads[f"{out['worker']} {k}"] = v
    t0 = env_vars.number("GPU_TEST_T0", -1.0)
    session_s = time.perf_counter() - state.start
    rows = wall_time.breakdown(
        script_start=t0 if t0 >= 0 else None,
        process_start=wall_time.process_start_epoch(),
        configured=state.configured,
        session_start=state.session_start,
        cuda_context_s=state.cuda_context_s,
        test_seconds=[(o.test, o.duration_s) for o in run.outcomes],
        kernel_loads=loads,
        clock=state.clock,
        session_s=None if workers else session_s,
        workers=workers,
        setup_s=setup if (setup := env_vars.number(wall_time.SETUP_ENV, -1.0)) >= 0 else None,
    )
    if workers:
        rows.append(
            (
                f"session, over {workers} pytest-xdist workers",
                session_s,
                "the tests' and fixtures' seconds above are summed over the workers, which ran at the same time; "
                "each worker also imported torch and created its own CUDA context",
            )
        )
        timelines = [o["timeline"] for o in state.worker_outputs if o.get("timeline")]
        rows += wall_time.worker_rows(timelines, state.session_start)
    run.add_series(
        Series(
            "session",
            "wall-time breakdown",
            ("phase", "seconds", "detail"),
            tuple((p, None if v is None else round(v, 2), d) for p, v, d in rows),
        )
    )


def kernel_variants(run: RunReport, worker_outputs: list[dict[str, Any]]) -> None:
    """Runs that launched lora_core's RawKernels (here, or in the xdist workers whose ``worker_outputs`` arrived):
    every variant reached (``lora_core.ops.kernel_variants``) with its launches and first grid, and the designed
    variants this run did not reach; one table per kernel."""
    kv = sys.modules.get("lora_core.ops.kernel_variants")
    reached = kv.reached() if kv is not None else {}
    if worker_outputs:  # launches added up over the workers
        from lora_core.ops import kernel_variants as imported

        kv = imported
        merged = worker_records.merge_variants([out.get("variants", []) for out in worker_outputs])
        reached = {kv.Variant(*key): kv.Launches(*value) for key, value in merged.items()}
    if kv is None or not reached:
        return
    designed = set(kv.DESIGNED)
    rows = [(v, n.count, f"{n.grid} x {n.block}", "yes" if v in designed else "no") for v, n in sorted(reached.items())]
    rows += [(v, 0, "-", "yes: NOT REACHED") for v in kv.unreached(reached)]
    for kernel in sorted({v.kernel for v, *_ in rows}):
        run.add_series(
            Series(
                "session",
                f"RawKernel variants reached: {kernel}",
                ("dtype", "variant", "launches", "first grid x block", "designed"),
                tuple((v.dtype, v.variant, *rest) for v, *rest in rows if v.kernel == kernel),
            )
        )


def worker_output(run: RunReport, state: SessionState, worker: str) -> dict[str, Any]:
    """An xdist worker at its session's end: its last records, RawKernel variants, kernel load times and its
    timeline (``wall_time.worker_rows``)."""
    kv = sys.modules.get("lora_core.ops.kernel_variants")
    interop = sys.modules.get("lora_core.ops.cupy_interop")
    variants = [
        (v.kernel, v.dtype, v.variant, n.count, list(n.grid), list(n.block))
        for v, n in (kv.reached() if kv is not None else {}).items()
    ]
    if state.outbox is None:
        raise ValueError(f"worker {worker}: no outbox in the session's state (expected one in an xdist worker)")
    return {
        "worker": worker,
        "changes": state.outbox.changes(run),
        "variants": variants,
        "kernel_loads": dict(getattr(interop, "KERNEL_LOAD_SECONDS", {})),
        "timeline": state.clock.timeline(
            worker,
            process_start=wall_time.process_start_epoch(),
            configured=state.configured,
            preload_s=state.preload_s,
            cuda_context_s=state.cuda_context_s,
            end=time.time(),
        ),
    }
