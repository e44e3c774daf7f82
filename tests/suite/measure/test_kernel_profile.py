"""The kernel families of a profiled step (lora_suite/measure/kernel_profile.py): names to families, GEMM roles from
eager role ranges, medians against the span."""

from __future__ import annotations

import pytest

from lora_suite.measure.kernel_profile import (
    FAMILY_ORDER,
    OTHER,
    UNATTRIBUTED,
    family_of,
    gemm_role,
    kernel_profile,
    profile_table,
    roles_by_key,
    step_families,
)


@pytest.mark.parametrize(
    "name, family",
    [
        ("nf4_dequantize<__nv_bfloat16, 4>", "NF4 dequantisation"),
        ("void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>(float*, ...)", "NF4 dequantisation"),
        ("nvjet_tst_128x64_64x8_2x1_v_bz_coopA_TNT", "GEMM"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "GEMM"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>", "GEMM"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "GEMM"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
        ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80", "attention"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
        ("Memcpy HtoD (Pageable -> Device)", "copies"),
        ("Memset (Device)", "copies"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", OTHER),
        ("_rms_norm_forward_kernel", OTHER),
        ("swiglu_forward<__nv_bfloat16>", OTHER),
    ],
)
def test_kernel_names_fall_in_their_family(name, family):
    assert family_of(name) == family


@pytest.mark.parametrize(
    "m, n, k, rank, role",
    [
        (512, 4096, 4096, 8, "base GEMM"),  # x·Wᵀ
        (512, 8, 4096, 8, "LoRA GEMM"),  # x·Aᵀ
        (512, 4096, 8, 8, "LoRA GEMM"),  # h·Bᵀ
        (8, 4096, 512, 8, "LoRA GEMM"),  # dA
        (512, 24, 4096, 8, "LoRA GEMM"),  # q/k/v's stacked A: 3r
        (512, 25, 4096, 8, "base GEMM"),  # one more than 3r
    ],
)
def test_a_gemm_with_a_dimension_of_at_most_3r_is_a_lora_gemm(m, n, k, rank, role):
    assert gemm_role(m, n, k, rank) == role


def test_a_rank_below_one_is_refused_by_value():
    with pytest.raises(ValueError, match="rank=0"):
        gemm_role(512, 512, 512, 0)


EAGER = [  # (name, start, end) µs; the GEMM "g" launched three times, the first two inside role ranges
    ("g", 0.0, 10.0),
    ("nf4_dequantize", 10.0, 12.0),
    ("g", 12.0, 14.0),
    ("vectorized_elementwise_kernel", 14.0, 15.0),
    ("g", 15.0, 25.0),
]
RANGES = [("base GEMM", 0.0, 10.0), ("LoRA GEMM", 11.5, 14.0)]


def gemm_named(step):
    return [("nvjet_" + n if n == "g" else n, s, e) for n, s, e in step]


def test_roles_come_from_the_eager_ranges_by_name_and_occurrence():
    roles = roles_by_key(gemm_named(EAGER), RANGES)
    assert roles == {("nvjet_g", 0): "base GEMM", ("nvjet_g", 1): "LoRA GEMM"}


def test_a_gemm_outside_every_range_stays_unattributed():
    families = step_families(gemm_named(EAGER), roles_by_key(gemm_named(EAGER), RANGES))
    assert families["base GEMM"] == (1, 10.0)
    assert families["LoRA GEMM"] == (1, 2.0)
    assert families[UNATTRIBUTED] == (1, 10.0)
    assert families["NF4 dequantisation"] == (1, 2.0)
    assert families[OTHER] == (1, 1.0)


def test_the_profile_takes_medians_over_steps_and_sets_them_against_the_span():
    roles = roles_by_key(gemm_named(EAGER), RANGES)
    slow = [(n, s, e + 2.0 if n == "nf4_dequantize" else e) for n, s, e in gemm_named(EAGER)]
    profile = kernel_profile([gemm_named(EAGER), gemm_named(EAGER), slow], [0.030, 0.030, 0.032], roles)
    rows = {r.family: r for r in profile.rows}
    assert rows["NF4 dequantisation"].ms == pytest.approx(0.002)  # the median step, not the slow one
    assert profile.span_ms == pytest.approx(0.030)
    assert profile.kernel_ms == pytest.approx(0.025)
    assert profile.gap == pytest.approx(1 - 25 / 30)
    assert [r.family for r in profile.rows] == [f for f in FAMILY_ORDER if f in rows]
    assert "| NF4 dequantisation | 1 | 0.00 |" in profile_table(profile)


def test_steps_and_spans_must_pair():
    with pytest.raises(ValueError, match="2 profiled steps and 1 spans"):
        kernel_profile([EAGER, EAGER], [1.0], {})
