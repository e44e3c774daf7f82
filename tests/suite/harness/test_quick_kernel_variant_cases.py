"""The quick tier's kernel-variant cases (tiers/quick/test_kernel_variant_parity.py) on the host: the case built for
each designed SwiGLU variant makes the launcher choose that variant, every designed kernel has a case, and the
defect selftest-gpu plants (lora_suite.scenarios.swiglu_wrong_variant) is a variant outside the catalogue."""

from __future__ import annotations

import pytest
import torch

from lora_core.ops import fused_engine as fe
from lora_core.ops import kernel_variants as kv
from lora_suite.scenarios import swiglu_wrong_variant
from lora_suite.tiers.quick import test_kernel_variant_parity as quick


@pytest.fixture(autouse=True)
def _clean_record(monkeypatch):
    monkeypatch.setattr(kv, "_REACHED", {})


def test_every_designed_kernel_has_a_quick_case():
    assert {v.kernel for v in kv.DESIGNED} == set(quick.CASES)
    assert len(set(kv.DESIGNED)) == len(kv.DESIGNED)


@pytest.mark.parametrize("variant", [v for v in kv.DESIGNED if v.kernel.startswith("swiglu")], ids=quick._id)
def test_the_quick_case_width_makes_the_launcher_choose_its_variant(variant):
    """The launcher's choice for the I the quick case uses: what the GPU test asserts after its launch."""
    dtype = quick.DTYPES[variant.dtype]
    name, grid = fe._swiglu_launch(
        dtype, quick.ROWS, quick._inter(variant.variant, kv.SWIGLU_VEC_WIDTH[variant.dtype]), variant.kernel
    )
    assert set(kv.reached()) == {variant}
    vec = variant.variant.split(",")[0].removeprefix("VEC=")
    assert name.endswith(f", {vec}>") and grid[1] == quick.ROWS


def test_a_vector_choice_for_i_a_multiple_of_four_takes_the_wrong_variant(monkeypatch):
    """The planted defect of selftest-gpu (swiglu_wrong_variant) is a different variant on the host already."""
    monkeypatch.setattr(fe, "_swiglu_vec", swiglu_wrong_variant.vectors_whenever_four_divide)
    fe._swiglu_launch(torch.bfloat16, 37, 1028, "swiglu_forward")
    assert set(kv.reached()) == {kv.Variant("swiglu_forward", "bf16", "VEC=8, I%8=4")}
    assert kv.Variant("swiglu_forward", "bf16", "VEC=8, I%8=4") not in kv.DESIGNED


def test_the_report_lists_every_variant_reached_and_the_designed_ones_not_reached(monkeypatch):
    from lora_suite.harness.report import RunReport
    from lora_suite.harness.session_tables import kernel_variants
    from lora_suite.settings.environment import collect_environment

    run = RunReport("r", "quick", collect_environment())
    kernel_variants(run, [])
    assert run.series == []  # nothing launched: no table
    kv.note("swiglu_forward", "bf16", "VEC=8, I%8=0", (4, 37), (256,))
    kv.note("swiglu_forward", "bf16", "VEC=8, I%8=0", (4, 37), (256,))
    kv.note("swiglu_forward", "bf16", "VEC=1, I%8=2", (4, 37), (256,))
    kernel_variants(run, [])
    tables = {s.name: s.rows for s in run.series}
    swiglu = tables["RawKernel variants reached: swiglu_forward"]
    assert ("bf16", "VEC=8, I%8=0", 2, "(4, 37) x (256,)", "yes") in swiglu
    assert ("bf16", "VEC=1, I%8=2", 1, "(4, 37) x (256,)", "no") in swiglu
    assert ("bf16", "VEC=1, I%8=4", 0, "-", "yes: NOT REACHED") in swiglu
    assert set(tables) == {f"RawKernel variants reached: {k}" for k in {v.kernel for v in kv.DESIGNED}}
    assert sum(len(rows) for rows in tables.values()) == len(kv.DESIGNED) + 1
