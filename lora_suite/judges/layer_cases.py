"""The drawn cases of the layer properties (``lora_suite.judges.layer_properties``): what one case is (``LayerCase``,
a probe block of drawn widths, rank, alpha, dtypes, layout and seed), what an implementation lets be drawn
(``Limits``, from its ``not_applicable``), the strategy (``cases``: half the blocks square, every projection
in = out; ranks that reach 64, 128 and 256 as often as the small ones) and the cases run first whatever is drawn
(``explicit``: a scale inexact in bf16, a biased block, and the edges, r = 256 above every layer's smaller dimension
on square and non-square bias-free blocks)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from hypothesis import strategies as st

from lora_suite.engine import probes as P
from lora_suite.implementations import AdapterSpec, LoRAImplementation

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CONFIGS = {  # name: (activation and base dtype, adapter dtype), as the probe grids name them
    "fp32": (F32, F32),
    "fp16": (F16, F16),
    "bf16": (BF16, BF16),
    "fp16-act+fp32-adapters": (F16, F32),
    "bf16-act+fp32-adapters": (BF16, F32),
}
LAYOUTS = ("2d", "3d", "noncontig")
MAX_RANK = 256


@dataclass(frozen=True)
class LayerCase:
    """One drawn case; its ``repr`` is the Python that rebuilds it."""

    config: str
    hidden: int
    q_out: int
    kv_out: int
    intermediate: int
    tokens: int
    layout: str
    r: int
    alpha: float
    rslora: bool
    bias: bool
    seed: int
    nf4: bool = False  # the implementation's own 4-bit base (one that has no 16-bit base)
    pattern: bool = (
        False  # per-module overrides (PEFT's rank_pattern, alpha_pattern): v_proj's r and alpha, down_proj's alpha
    )

    def shape(self) -> P.BlockShape:
        return P.BlockShape("drawn", self.hidden, self.q_out, self.kv_out, self.intermediate, self.bias)

    def dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        return CONFIGS[self.config]

    def spec(self) -> AdapterSpec:
        adapter = self.dtypes()[1]
        ranks: tuple[str, ...] = ()
        alphas: tuple[str, ...] = ()
        if self.pattern:  # another rank and alpha for v_proj, another alpha for down_proj, both inexact scales
            ranks = (f"v_proj={self.r + 3 if self.r <= 8 else self.r // 2}",)
            alphas = (f"v_proj={self.alpha * 1.7 + 0.3!r}", f"down_proj={self.alpha / 2.9!r}")
        quantize = "nf4" if self.nf4 else None
        return AdapterSpec(P.PROBE_TARGETS, self.r, self.alpha, self.rslora, adapter, quantize, ranks, alphas)

    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


def exact_in(value: float, dtype: torch.dtype) -> bool:
    """Whether ``value`` is representable in ``dtype`` (its round trip through it gives it back)."""
    return float(torch.tensor(value, dtype=torch.float64).to(dtype).double()) == value


@dataclass(frozen=True)
class Limits:
    """What an implementation lets the properties draw (from its ``not_applicable``) and how large: the CPU self-tests
    use tiny widths, the quick tier on a GPU wider ones."""

    configs: tuple[str, ...]
    rslora: bool
    bias: bool
    nf4: bool
    two_d: bool
    pattern: bool
    max_width: int
    max_tokens: int

    @classmethod
    def of(cls, impl: LoRAImplementation, max_width: int = 64, max_tokens: int = 40) -> Limits:
        mixed = impl.reason_not_applicable("fp32_adapters_on_16bit_base") is None
        configs = tuple(c for c, (act, ad) in CONFIGS.items() if mixed or act == ad)
        nf4 = impl.reason_not_applicable("bf16_base") is not None
        return cls(
            configs,
            impl.reason_not_applicable("rslora") is None,
            bias_reason(impl) is None and not nf4,
            nf4,
            impl.reason_not_applicable("inputs_2d") is None,
            impl.reason_not_applicable("rank_pattern") is None,
            max_width,
            max_tokens,
        )


def bias_reason(impl: LoRAImplementation) -> str | None:
    """Why the implementation takes no base bias (its ``linear_bias`` feature)."""
    return impl.reason_not_applicable("linear_bias")


def cases(limits: Limits) -> st.SearchStrategy[LayerCase]:
    """Drawn cases within ``limits``; widths in NF4's blocks of 64 where the base is 4-bit."""
    if limits.nf4:
        width = st.integers(1, max(1, limits.max_width // 64)).map(lambda k: 64 * k)
    else:
        width = st.integers(1, limits.max_width)
    widths = st.one_of(st.tuples(width, width, width, width), width.map(lambda w: (w, w, w, w)))  # half square
    return widths.flatmap(lambda ws: _case_of_widths(limits, ws))


def _case_of_widths(limits: Limits, ws: tuple[int, int, int, int]) -> st.SearchStrategy[LayerCase]:
    """Drawn cases of the block widths ``ws`` (hidden, q_out, kv_out, intermediate)."""
    return st.builds(
        LayerCase,
        config=st.sampled_from(limits.configs),
        hidden=st.just(ws[0]),
        q_out=st.just(ws[1]),
        kv_out=st.just(ws[2]),
        intermediate=st.just(ws[3]),
        tokens=st.integers(2, limits.max_tokens),
        layout=st.sampled_from(LAYOUTS if limits.two_d else ("3d",)),
        r=ranks(),
        alpha=st.floats(0.05, 128.0, allow_nan=False, allow_infinity=False),
        rslora=st.booleans() if limits.rslora else st.just(False),
        bias=st.booleans() if limits.bias else st.just(False),
        seed=st.integers(0, 2**16 - 1),
        nf4=st.just(limits.nf4),
        pattern=st.booleans() if limits.pattern else st.just(False),
    )


def ranks() -> st.SearchStrategy[int]:
    """Ranks over 1..MAX_RANK that reach the large end as often as the small (Hypothesis draws small integers first):
    small ranks, any rank, and the ranks people train at (64, 128, 256), each a third of the draws."""
    return st.one_of(st.integers(1, 16), st.integers(1, MAX_RANK), st.sampled_from((64, 128, MAX_RANK)))


def explicit(limits: Limits) -> list[LayerCase]:
    """Cases run first whatever is drawn: a scale inexact in bf16 and fp16 (7.3 / 3) in the first configuration and,
    where a bias is taken, on a biased block; so that every run judges both classes. Then the edges: bias-free blocks
    (the merge property judges only those) of square layers (every projection in = out: a merge oriented by the
    weight's shape is wrong only there) and of non-square ones, at r = MAX_RANK, above every layer's smaller
    dimension (a rank cut to min(in, out) or to a kernel's tile shows only there)."""
    w = 64 if limits.nf4 else 37
    base = LayerCase(limits.configs[0], w, w, w, w, 5, "3d", 3, 7.3, False, limits.bias, 11, limits.nf4)
    narrow = 64 if limits.nf4 else 24
    square = LayerCase(
        limits.configs[0], narrow, narrow, narrow, narrow, 6, "3d", MAX_RANK, 300.7, False, False, 13, limits.nf4
    )
    oblong = LayerCase(
        limits.configs[-1],
        w,
        narrow,
        2 * narrow,
        w,
        4,
        "3d",
        MAX_RANK // 2 + 3,
        41.3,
        False,
        False,
        14,
        limits.nf4,
        limits.pattern,  # and per-module overrides where the stack takes them
    )
    return [base, LayerCase(**{**asdict(base), "config": limits.configs[-1], "seed": 12}), square, oblong]
