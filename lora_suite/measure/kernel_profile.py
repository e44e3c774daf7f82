"""Where a training step's device time goes: its kernels sorted into families, summed, and set against the step's span.

A step's kernels are read from CUPTI (``torch.profiler``), each as (name, start µs, end µs). Each goes to the first
family whose rule its name meets (``FAMILIES``, case-insensitive regular expressions), in this order:

- ``NF4 dequantisation``: the name says ``dequant`` (lora_core's ``nf4_dequantize``, bitsandbytes'
  ``kDequantizeBlockwise``, a Triton ``dequant`` kernel);
- ``attention``: flash/memory-efficient attention (``flash``, ``fmha``, ``attention``), before the GEMMs: its
  CUTLASS kernels are attention's;
- ``GEMM``: cuBLAS/cuBLASLt and CUTLASS kernels (``gemm``, ``nvjet``, ``cutlass``, ``xmma``, ``splitKreduce``,
  ``gemv``), split into ``base GEMM`` and ``LoRA GEMM`` where their role is known (below), else ``GEMM (role not
  attributed)``;
- ``optimizer``: the optimizer's multi-tensor kernels (``multi_tensor``, ``adam``, ``foreach``);
- ``copies``: memcpy and memset;
- ``elementwise and reductions``: everything else (PyTorch's elementwise and reduce kernels, norms, RoPE, SwiGLU,
  casts, Triton-fused ops, lora_core's own RawKernels).

The role of a GEMM comes from an eager step of the same model, where each GEMM call of the implementation ran inside
a profiler range naming its role (``lora_suite.engine.kernel_attribution``): a GEMM is a LoRA GEMM when one of its
three dimensions is at most ``3r`` (x·Aᵀ, h·Bᵀ and their gradients, q/k/v's stacked A included), else a base GEMM.
A kernel is identified by (name, how many launches of that name came before it in the step): the eager and the
captured step launch the same kernels in the same order, so the roles read on one apply to the other.

Against the span. On one stream the kernels of a captured step run one after the other, so with S the replay's span
(CUDA events around it) and K = Σ_k d_k the summed kernel time, K ≤ S and S − K is the time the GPU sat between
kernels: ``gap = 1 − K/S``.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lora_suite.measure.device_time import TimedLaunch, launch_keys

FAMILIES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (family, re.compile(pattern, re.IGNORECASE))
    for family, pattern in (
        ("NF4 dequantisation", r"dequant"),
        ("attention", r"flash|fmha|attention"),
        ("GEMM", r"gemm|nvjet|cutlass|xmma|splitkreduce|gemv"),
        ("optimizer", r"multi_tensor|adam|foreach"),
        ("copies", r"memcpy|memset"),
    )
)
OTHER = "elementwise and reductions"
GEMM_ROLES = ("base GEMM", "LoRA GEMM")
UNATTRIBUTED = "GEMM (role not attributed)"
FAMILY_ORDER = ("NF4 dequantisation", *GEMM_ROLES, UNATTRIBUTED, "attention", "optimizer", OTHER, "copies")


def family_of(name: str) -> str:
    """The family a kernel's name puts it in (module docstring), GEMMs not yet split by role."""
    return next((family for family, rule in FAMILIES if rule.search(name)), OTHER)


def gemm_role(m: int, n: int, k: int, rank: int) -> str:
    """``LoRA GEMM`` when one of out = op(a)·op(b)'s dimensions m×k·k×n is at most 3r, else ``base GEMM``."""
    if rank < 1:
        raise ValueError(f"rank={rank}: expected the adapters' rank r >= 1")
    return GEMM_ROLES[1] if min(m, n, k) <= 3 * rank else GEMM_ROLES[0]


def roles_by_key(kernels: Sequence[TimedLaunch], ranges: Sequence[TimedLaunch]) -> dict[tuple[str, int], str]:
    """The role of each GEMM kernel of an eager step: the name of the role range (name, start, end) that holds it.

    A kernel belongs to a range when it starts and ends within it; a GEMM outside every range gets no role."""
    keys = launch_keys([(name, end - start) for name, start, end in kernels])
    roles = {}
    for key, (name, start, end) in zip(keys, kernels):
        if family_of(name) != "GEMM":
            continue
        holder = next((r for r, r0, r1 in ranges if r0 <= start and end <= r1), None)
        if holder is not None:
            roles[key] = holder
    return roles


def step_families(kernels: Sequence[TimedLaunch], roles: Mapping[tuple[str, int], str]) -> dict[str, tuple[int, float]]:
    """Family -> (launches, summed µs) of one step, GEMMs split by ``roles`` where known."""
    out: dict[str, tuple[int, float]] = {}
    keys = launch_keys([(name, end - start) for name, start, end in kernels])
    for key, (name, start, end) in zip(keys, kernels):
        family = family_of(name)
        if family == "GEMM":
            family = roles.get(key, UNATTRIBUTED)
        count, total = out.get(family, (0, 0.0))
        out[family] = (count + 1, total + (end - start))
    return out


@dataclass(frozen=True)
class FamilyRow:
    """One family over the profiled steps: launches per step, median ms per step, its share of the median span."""

    family: str
    launches: int
    ms: float
    share: float


@dataclass(frozen=True)
class KernelProfile:
    """The families of the profiled steps, their summed kernel time K and the span S (medians over the steps)."""

    rows: tuple[FamilyRow, ...]
    kernel_ms: float  # median over steps of K
    span_ms: float  # median over steps of S
    steps: int

    @property
    def gap(self) -> float:
        """1 − K/S: the share of the span in which no kernel of the step ran."""
        return 1.0 - self.kernel_ms / self.span_ms


def kernel_profile(
    steps: Sequence[Sequence[TimedLaunch]], spans_ms: Sequence[float], roles: Mapping[tuple[str, int], str]
) -> KernelProfile:
    """The profile of several steps of one kind (captured replays): medians over the steps, families in
    ``FAMILY_ORDER`` (those with no launch left out)."""
    if not steps or len(steps) != len(spans_ms):
        raise ValueError(f"{len(steps)} profiled steps and {len(spans_ms)} spans: expected as many, at least one")
    per_step = [step_families(s, roles) for s in steps]
    span = statistics.median(spans_ms)
    rows = []
    for family in FAMILY_ORDER:
        if not any(family in f for f in per_step):
            continue
        ms = statistics.median(f.get(family, (0, 0.0))[1] / 1e3 for f in per_step)
        launches = round(statistics.median(f.get(family, (0, 0.0))[0] for f in per_step))
        rows.append(FamilyRow(family, launches, ms, ms / span))
    kernel_ms = statistics.median(sum(d for _, d in f.values()) / 1e3 for f in per_step)
    return KernelProfile(tuple(rows), kernel_ms, span, len(steps))


def profile_table(profile: KernelProfile) -> str:
    """The profile as a Markdown table for the report's notes and docs."""
    lines = ["| family | launches per step | ms per step | share of the span |", "|---|---|---|---|"]
    lines += [f"| {r.family} | {r.launches} | {r.ms:.2f} | {100 * r.share:.1f}% |" for r in profile.rows]
    lines.append(
        f"| all kernels (K) against the step span (S) | | {profile.kernel_ms:.2f} of {profile.span_ms:.2f} | "
        f"gap {100 * profile.gap:.1f}% |"
    )
    return "\n".join(lines)
