"""The layer contract as properties over drawn cases, for the implementation under test whatever it is
(``lora_suite.judges.layer_properties``): widths, ranks 1 to 256, alpha drawn from the reals (scales inexact in bf16
and fp16), every dtype configuration it takes, base bias on and off, 2-D, 3-D and non-contiguous inputs; the float64
function within the error model, the base frozen and untouched, the merged weight rounded once, NaN/Inf carried to
where F.linear and autograd carry them. A failure is shrunk to a minimal case, printed in the check's detail with the
lines that reproduce it.

The cases are derandomised (``LORA_SUITE_HYPOTHESIS_PROFILE``: ``ci``, the default, draws the same cases every run;
``nightly`` draws new ones, more of them). What the implementation declares it cannot do narrows what is drawn and is
recorded as not applicable with its reason.
"""

from __future__ import annotations

import pytest

from lora_suite.harness.report import Series
from lora_suite.judges import layer_properties as LP

pytestmark = [pytest.mark.gpu, pytest.mark.quick]

DEV = "cuda"
MAX_WIDTH, MAX_TOKENS = 320, 96  # wide enough for tiles to be ragged on every side, small enough for quick's budget
COVERAGE = {
    "scale inexact in bf16": "the class the fixed grids miss: every scale they use (12/8, 12/4) is exact in bf16",
    "base bias": "projections with a base bias (Qwen2's q/k/v): the probe grids are bias-free",
    "rank of 128 or more": "the ranks people train at (128 to 256): the probe grids stop at r = 8",
    "rank above a layer's smaller width": "r > min(in, out), where a rank cut to the layer's width shows",
    "square block": "square layers (in = out), where a merge oriented by the weight's shape goes wrong",
    "per-module rank and alpha": "PEFT's rank_pattern and alpha_pattern: a layer's own r and alpha, its own scale",
}
# which property must have judged each class (the merge property judges bias-free cases only)
COVERED_BY = {
    "scale inexact in bf16": "function",
    "base bias": "function",
    "rank of 128 or more": "function",
    "rank above a layer's smaller width": "function",
    "square block": "merge",
    "per-module rank and alpha": "function",
}


def _record(check, v):
    check(v.name, v.value, v.op, v.threshold, source=v.source, detail=v.detail)


@pytest.mark.parametrize("prop", ["function", "merge", "non_finite"])
def test_layer_contract_holds_on_drawn_cases(prop, lora_impl, check, run_report):
    limits = LP.Limits.of(lora_impl, MAX_WIDTH, MAX_TOKENS)
    if prop == "merge" and (why := LP.merge_reason(lora_impl, limits)):
        check.not_applicable(LP.NAMES[prop], why)
        return
    run = LP.run_property(prop, lora_impl, limits, DEV)
    _record(check, LP.verdict_of(prop, run))
    run_report.add_series(
        Series(
            test=f"layer properties {prop}",
            name=f"{lora_impl.name}: drawn cases of the {prop} property",
            columns=("cases judged", *run.tally, "minimal failing case"),
            rows=((run.cases, *run.tally.values(), run.failure or "none"),),
        )
    )
    for what, why in COVERAGE.items():
        if COVERED_BY[what] != prop:
            continue
        if what == "base bias" and not limits.bias:
            reason = LP.bias_reason(lora_impl) or f"{lora_impl.name}'s base is always 4-bit"
            check.not_applicable(f"layer properties: drawn cases judged with a {what}", reason)
            continue
        if what == "per-module rank and alpha" and not limits.pattern:
            reason = lora_impl.reason_not_applicable("rank_pattern") or "(no reason given)"
            check.not_applicable(f"layer properties: drawn cases judged with a {what}", reason)
            continue
        check(f"layer properties: drawn cases judged with a {what}", run.tally[what], ">=", 1, source=why)
