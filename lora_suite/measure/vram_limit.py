"""``--vram-limit GiB``: a tier judged as if on a smaller card (issue 56, item 6), so that a team whose runners are
H100s can validate for the 16 and 24 GB cards its users train on.

A card of L GiB holds the CUDA context (``card.CONTEXT_BYTES``, outside torch's allocator) and what torch's caching
allocator reserves. So this process's allocator is capped at

    cap = L·2³⁰ − context,   fraction = cap / total   (``torch.cuda.set_per_process_memory_fraction``)

beyond which an allocation raises ``torch.cuda.OutOfMemoryError`` as it would on the small card (CuPy's pool goes
through torch's allocator: lora_core's kernels count too). The ``--check-vram`` pre-check takes the smaller of
NVML's free memory and L as the free memory (``limited_free``), so a tier that cannot fit says so before it runs.
A limit above the GPU's own memory is refused: the run would judge the GPU, not the card named.
"""

from __future__ import annotations

import math

from lora_suite.measure.card import CONTEXT_BYTES, GIB


class VramLimitError(ValueError):
    """A ``--vram-limit`` that names no card this GPU can stand for."""


def parse_limit(text: str) -> float:
    """The option's value: a finite size in GiB, above the CUDA context."""
    try:
        gib = float(text)
    except (TypeError, ValueError):
        gib = math.nan
    if not math.isfinite(gib) or gib * GIB <= CONTEXT_BYTES:
        raise VramLimitError(
            f"--vram-limit {text}: expected a card's memory in GiB, a number above the CUDA context's "
            f"{CONTEXT_BYTES / GIB:.1f} (e.g. 16 or 24)"
        )
    return gib


def memory_fraction(limit_gib: float, total_bytes: int) -> float:
    """The fraction of this GPU's ``total_bytes`` torch's allocator may reserve to stand for a card of
    ``limit_gib``."""
    if limit_gib * GIB > total_bytes:
        raise VramLimitError(
            f"--vram-limit {limit_gib:g}: more than this GPU's {total_bytes / GIB:.1f} GiB; expected at most that"
        )
    return (limit_gib * GIB - CONTEXT_BYTES) / total_bytes


def limited_free(free_bytes: int, limit_gib: float | None, held_bytes: int = 0) -> int:
    """The free memory the pre-check judges against: NVML's, and under a limit no more than the card's memory less
    what this process already holds (``held_bytes``, torch's reserved memory)."""
    if limit_gib is None:
        return free_bytes
    return max(0, min(free_bytes, int(limit_gib * GIB) - held_bytes))


def apply_limit(limit_gib: float, device: int = 0) -> str:
    """Cap this process's allocator on ``device`` to stand for a card of ``limit_gib``; the report's note."""
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    fraction = memory_fraction(limit_gib, total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return (
        f"--vram-limit {limit_gib:g} GiB: judged as on a {limit_gib:g} GiB card; torch's allocator capped at "
        f"{fraction * total / GIB:.2f} GiB ({fraction:.4f} of this GPU's {total / GIB:.1f} GiB, the CUDA context's "
        f"{CONTEXT_BYTES / GIB:.1f} GiB left out)"
    )
