"""Which path through each RawKernel its launcher chose: the record that proves every branch is reached.

A launcher whose kernel has more than one path (a template argument, a vector width, a runtime branch on its
arguments, a partial last block, a grid-stride loop) reports each launch as a ``Variant(kernel, dtype, variant)``,
``variant`` naming what it chose and the input class that decided it, e.g.::

    Variant("swiglu_forward", "bf16", "VEC=1, I%8=4")   # scalar loads: I is a multiple of 4, not of 8

``DESIGNED`` lists the variants each kernel is built to take, per dtype. The quick tier runs one parity case
per designed variant and asserts that the launch took it (``lora_suite/tiers/quick/test_kernel_variant_parity.py``);
the report lists every variant reached in the run, with its launches and an example grid.

Recording is one dict update per launch, on the host (a captured graph records its launches once, at capture).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class _DtypeNames(dict):
    """torch dtype -> "fp32"/"bf16"/"fp16", each filled on its first lookup: this module imports no torch, so that a
    process that only merges other processes' records (the controller of a run spread over workers) never does."""

    _BY_TEXT = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}

    def __missing__(self, dtype):
        name = self._BY_TEXT.get(str(dtype))
        if name is None:
            raise KeyError(f"no kernel variants for dtype {dtype}: expected one of {sorted(self._BY_TEXT)}")
        self[dtype] = name
        return name


DTYPE_NAME = _DtypeNames()


@dataclasses.dataclass(frozen=True, order=True)
class Variant:
    kernel: str  # the kernel's name in its .cu file, without template arguments
    dtype: str  # "fp32", "bf16" or "fp16": the template's element type (the output's, for the casts)
    variant: str  # what the launcher chose, and the input class that decided it


@dataclasses.dataclass
class Launches:
    count: int
    grid: tuple[int, ...]  # of the first launch seen
    block: tuple[int, ...]


# (kernel, dtype name, variant) -> [launches, first grid, block]: plain tuples and lists, since ``note`` runs on
# every launch, on the host (the eager training step's own path); ``reached`` builds the records
_REACHED: dict[tuple[str, str, str], list] = {}


def note(kernel: str, dtype: torch.dtype | str, variant: str, grid: tuple[int, ...], block: tuple[int, ...]) -> None:
    """Record one launch of ``kernel`` taking ``variant``."""
    key = (kernel, dtype if isinstance(dtype, str) else DTYPE_NAME[dtype], variant)
    seen = _REACHED.get(key)
    if seen is None:
        _REACHED[key] = [1, tuple(grid), tuple(block)]
    else:
        seen[0] += 1


def reached() -> dict[Variant, Launches]:
    """Every variant launched in this process so far (a copy: a snapshot to diff against)."""
    return {Variant(*key): Launches(*seen) for key, seen in _REACHED.items()}


def reached_since(before: dict[Variant, Launches]) -> set[Variant]:
    """Variants launched after the snapshot ``before`` was taken (new ones and ones launched again)."""
    now = reached()
    return {v for v, n in now.items() if v not in before or n.count > before[v].count}


# ---------------------------------------------------------------------------------------------
# The input classes launchers report
def residue(inter: int, width: int) -> str:
    """The class of a row width I against a vector width: "I%8=0", "I%8=4", "I odd"."""
    if inter % 2:
        return "I odd"
    return f"I%{width}={inter % width}"


def last_cta(work: int, per_cta: int) -> str:
    """Whether the last thread block has a full share of ``work`` items (bounds checks all pass) or not."""
    return "full last CTA" if work % per_cta == 0 else "partial last CTA"


def passes(n: int, grid_x: int, block_x: int) -> str:
    """A grid-stride loop's path: every thread one element at most, or some threads looping."""
    return "one pass" if n <= grid_x * block_x else "grid-stride"


# ---------------------------------------------------------------------------------------------
# What each kernel is built to take
SWIGLU_VEC_WIDTH = {"fp32": 4, "bf16": 8, "fp16": 8}  # elements per 16-byte vector
ABSMAX_FORMS = ("fp32", "int8", "dcode")  # plain absmax, lora_core's double quantisation, bitsandbytes'


def _designed() -> tuple[Variant, ...]:
    out = []
    for kernel in ("swiglu_forward", "swiglu_backward_inplace", "geglu_forward", "geglu_backward_inplace"):
        for dtype, w in SWIGLU_VEC_WIDTH.items():
            out += [
                Variant(kernel, dtype, f"VEC={w}, I%{w}=0"),
                Variant(kernel, dtype, f"VEC=1, I%{w}={w // 2}"),  # even, not a multiple: the aligned-looking trap
                Variant(kernel, dtype, "VEC=1, I odd"),
            ]
    for dtype in ("bf16", "fp16"):
        out += [Variant("cast_pair_from_f32", dtype, p) for p in ("one pass", "grid-stride")]
        out += [
            Variant("cast_stack_from_f32", dtype, s)
            for s in ("6 sources, one pass", "padded sources, one pass", "6 sources, grid-stride")
        ]
    for dtype in ("fp32", "bf16", "fp16"):
        out += [Variant("nf4_quantize", dtype, t) for t in ("full last CTA", "partial last CTA")]
        out += [
            Variant("nf4_dequantize", dtype, f"absmax={form}, {t}")
            for form in ABSMAX_FORMS
            for t in ("full last CTA", "partial last CTA")
        ]
    out += [Variant("absmax_quantize", "fp32", t) for t in ("full last CTA", "partial last CTA")]
    for dtype, w in SWIGLU_VEC_WIDTH.items():  # one block per row: V / VEC within one block's threads, or a loop;
        out += [  # 16-byte vectors where V is a multiple of their width (linear_cross_entropy.ce_vector_width)
            Variant("cross_entropy_rows", dtype, f"VEC={vec}, {p}")
            for vec in (w, 1)
            for p in ("one pass", "grid-stride", "grid-stride, softcap")
        ]
    return tuple(out)


DESIGNED: tuple[Variant, ...] = _designed()


def unreached(seen) -> list[Variant]:
    """The designed variants not in ``seen`` (a set or a ``reached()`` mapping), in catalogue order."""
    return [v for v in DESIGNED if v not in seen]
