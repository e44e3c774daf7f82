"""The record of RawKernel variants (lora_core.ops.kernel_variants) and the launchers' choices, on the host: which
variant each designed case takes is decided before any launch, so it is checked here without a GPU."""

from __future__ import annotations

import pytest
import torch

from lora_core.ops import kernel_variants as kv


@pytest.fixture(autouse=True)
def _clean_record(monkeypatch):
    monkeypatch.setattr(kv, "_REACHED", {})


def test_note_counts_launches_and_keeps_the_first_grid():
    kv.note("k", torch.bfloat16, "a", (4,), (256,))
    kv.note("k", "bf16", "a", (9,), (256,))
    assert kv.reached() == {kv.Variant("k", "bf16", "a"): kv.Launches(2, (4,), (256,))}


def test_reached_since_names_new_and_relaunched_variants_only():
    kv.note("k", "fp32", "a", (1,), (1,))
    kv.note("k", "fp32", "b", (1,), (1,))
    before = kv.reached()
    kv.note("k", "fp32", "b", (1,), (1,))
    kv.note("k", "fp32", "c", (1,), (1,))
    assert kv.reached_since(before) == {kv.Variant("k", "fp32", "b"), kv.Variant("k", "fp32", "c")}


def test_a_snapshot_is_not_moved_by_later_launches():
    kv.note("k", "fp32", "a", (1,), (1,))
    before = kv.reached()
    kv.note("k", "fp32", "a", (1,), (1,))
    assert before[kv.Variant("k", "fp32", "a")].count == 1


@pytest.mark.parametrize(
    ("inter", "width", "want"), [(1536, 8, "I%8=0"), (1004, 8, "I%8=4"), (1001, 8, "I odd"), (1002, 4, "I%4=2")]
)
def test_residue_classes(inter, width, want):
    assert kv.residue(inter, width) == want


def test_last_cta_and_passes():
    assert kv.last_cta(512, 8) == "full last CTA" and kv.last_cta(333, 8) == "partial last CTA"
    assert kv.passes(1024, 4, 256) == "one pass" and kv.passes(1025, 4, 256) == "grid-stride"


def test_unreached_lists_designed_variants_in_catalogue_order():
    first, second = kv.DESIGNED[:2]
    assert kv.unreached({first}) == list(kv.DESIGNED[1:])
    assert kv.unreached(set(kv.DESIGNED)) == [] and kv.unreached({})[:2] == [first, second]


def test_the_catalogue_has_the_issue_named_swiglu_classes_for_every_dtype():
    for dtype, w in kv.SWIGLU_VEC_WIDTH.items():
        got = {v.variant for v in kv.DESIGNED if v.kernel == "swiglu_forward" and v.dtype == dtype}
        assert got == {f"VEC={w}, I%{w}=0", f"VEC=1, I%{w}={w // 2}", "VEC=1, I odd"}


def test_a_dtype_without_kernel_variants_is_named():
    import torch

    from lora_core.ops import kernel_variants as kv

    assert kv.DTYPE_NAME[torch.bfloat16] == "bf16"
    with pytest.raises(KeyError, match=r"torch\.int8.*expected one of"):
        kv.DTYPE_NAME[torch.int8]
