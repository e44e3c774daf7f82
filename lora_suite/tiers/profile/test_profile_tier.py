"""profile tier: where the full tier's step spends its device time, by kernel family.

The full tier's workload (Llama-2-7B, NF4 base, q/k/v/o r8, 1×512, gradient checkpointing, captured) runs a few
steps: one eager warm-up step is profiled with lora_core's GEMMs inside role ranges (``base GEMM`` / ``LoRA GEMM``,
``lora_suite.engine.kernel_attribution``), then ``criteria.device_window`` captured replays are profiled and their
kernels sorted into families (``lora_suite.measure.kernel_profile``). The table goes to the report's notes and each
family's milliseconds to the report's figures.

An implementation that cannot be captured (Unsloth) is profiled on its eager steps: its kernel time K is then the
figure to set beside lora_core's, the host's share of an eager step being the gap.

What it judges is the profile itself, so that a figure drawn from it can be trusted: the kernels fit in the replay's
span (K ≤ S, one stream: they run one after another), and, where the implementation's GEMMs are lora_core's, the
roles read on the eager step carry over to the profiled ones: as many GEMMs are without a role in each (torch's own,
such as the LM head's), so every lora_core GEMM was matched.
"""

from __future__ import annotations

import pytest

from lora_suite.engine.kernel_attribution import KernelRecorder, gemm_roles
from lora_suite.harness.figures import record_figure
from lora_suite.measure.kernel_profile import (
    UNATTRIBUTED,
    kernel_profile,
    profile_table,
    roles_by_key,
    step_families,
)

pytestmark = [pytest.mark.gpu, pytest.mark.profile]

# The CUDA events around a replay and CUPTI's kernel timestamps are different clocks read at µs resolution: K may
# exceed S by that much (0.1% of a 50 ms step is 50 µs, well above it).
SPAN_CLOCK_SLACK = 1.001


def profiled_steps(cfg) -> tuple[int, list[int]]:
    """(the step whose GEMM role ranges are read, the steps profiled). Captured: the last eager warm-up step, and the
    last ``device_window`` replays. An implementation that cannot be captured runs eagerly (its tier config says so):
    the last ``device_window`` steps, the roles read on the first of them."""
    warmup = cfg.train.graph_warmup_steps if cfg.train.cuda_graph else 0
    steps, width = cfg.train.steps, cfg.criteria.device_window
    if (cfg.train.cuda_graph and warmup < 1) or steps - warmup <= width:
        raise ValueError(
            f"configs/profile.yaml: needs more than device_window={width} steps after graph_warmup_steps={warmup} "
            f"(>= 1 when captured); steps={steps}"
        )
    profiled = list(range(steps - width, steps))
    return (warmup - 1 if cfg.train.cuda_graph else profiled[0]), profiled


def test_step_kernel_profile(tier):
    cfg = tier.config("profile")
    kind = "captured replays" if cfg.train.cuda_graph else "eager steps (the implementation cannot be captured)"
    roles_at, profiled = profiled_steps(cfg)
    recorder = KernelRecorder({roles_at, *profiled})
    prepared = tier.prepare(cfg)
    with gemm_roles(cfg.lora.r) as wrapped:
        result = tier.train("profile", prepared, cfg, device_timer=recorder)
    roles = roles_by_key(recorder.timed[roles_at], recorder.ranges[roles_at])
    spans = {r.step: r.gpu_time_s * 1e3 for r in result.records if r.gpu_time_s is not None}
    present = [s for s in profiled if s in recorder.timed and s in spans]
    tier.check(f"profiled {kind}", len(present), "==", len(profiled), source="configs/profile.yaml device_window")
    profile = kernel_profile([recorder.timed[s] for s in present], [spans[s] for s in present], roles)
    tier.report.notes.append(f"{tier.nodeid}: kernel profile of {profile.steps} {kind}\n{profile_table(profile)}")
    for row in profile.rows:
        record_figure(tier.report, tier.nodeid, "profile", f"{row.family} ms per step", row.ms)
    record_figure(tier.report, tier.nodeid, "profile", "profiled step span", profile.span_ms)
    record_figure(tier.report, tier.nodeid, "profile", "kernel time in the profiled step", profile.kernel_ms)
    tier.check(
        "summed kernel time / step span (K/S)",
        round(profile.kernel_ms / profile.span_ms, 4),
        "<=",
        SPAN_CLOCK_SLACK,
        source="one stream: a step's kernels run one after another (module docstring)",
    )
    unattributed = next((r.launches for r in profile.rows if r.family == UNATTRIBUTED), 0)
    outside = step_families(recorder.timed[roles_at], roles).get(UNATTRIBUTED, (0, 0.0))[0]
    tier.report.notes.append(
        f"{tier.nodeid}: {outside} GEMM launches per step ran outside {prepared.implementation.name}'s role ranges "
        "(torch's own GEMMs, such as the LM head's, or every GEMM of an implementation whose GEMMs are not "
        "lora_core's): reported without a role, not guessed"
    )
    if wrapped and recorder.ranges[roles_at]:
        tier.check(
            "GEMM launches without a role, profiled step against the step the roles were read on",
            unattributed,
            "==",
            outside,
            source="the same kernels in the same order (module docstring)",
        )
