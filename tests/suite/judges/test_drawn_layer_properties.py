"""The layer properties (``lora_suite.judges.layer_properties``) on the CPU with the derandomised ``ci`` profile: they
hold for the torch reference implementation, PEFT and the shipped example; each plant of the two value classes
(``example_plants_values``) fails the property its table row names, shrunk to a minimal case with the lines that
reproduce it, while passing the fixed-value checks that let it through before."""

from __future__ import annotations

import math

import pytest
import torch

from lora_suite.engine import probes as P
from lora_suite.implementations import AdapterSpec
from lora_suite.implementations.lookup import resolve_implementation
from lora_suite.judges import layer_checks as L
from lora_suite.judges import layer_properties as LP
from lora_suite.judges import merge_rounding as MR
from lora_suite.judges.hypothesis_profiles import ENV, profile_name, suite_settings
from lora_suite.scenarios import example_plants as EP

WIDTH, TOKENS = 24, 12  # tiny: the CPU judges the logic, the GPU's quick tier the kernels at 320 x 96


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/suite/engine/conftest.py


def _run(impl, prop):
    return LP.run_property(prop, impl, LP.Limits.of(impl, WIDTH, TOKENS), "cpu")


@pytest.mark.parametrize("name", ["torch", "peft", "example"])
def test_the_properties_hold_for_correct_stacks(name):
    impl = EP._example().make() if name == "example" else resolve_implementation(name)
    for prop in ("function", "merge", "non_finite"):
        run = _run(impl, prop)
        assert run.failure is None, (prop, run.failure, run.reproduce)
        assert run.cases >= 10
        if prop == "merge":  # bias-free cases only: half the blocks drawn square, and a square case run first
            assert run.tally["square block"] >= 1 and run.tally["base bias"] == 0, run.tally
        else:
            drawn = {
                k: n for k, n in run.tally.items() if k != "per-module rank and alpha" or LP.Limits.of(impl).pattern
            }
            assert min(drawn.values()) >= 1, (prop, run.tally)


PLANTS = [
    "scale_rounded_bf16",
    "merge_delta_bf16",
    "adapter_grads_nan_to_num",
    "lora_input_nan_to_num",
    "lora_a_nan_to_num",
    "lora_input_grad_nan_to_num",
    "rank_cut_at_tile",
    "merge_oriented_by_shape",
]
PROPERTY_OF = {v: k for k, v in LP.NAMES.items()}


@pytest.mark.parametrize("plant", PLANTS)
def test_each_value_plant_fails_the_property_it_names(plant):
    (fragment,) = [frag for name, _, frag in EP.PLANTS.values() if name == plant]
    (prop,) = [p for name, p in PROPERTY_OF.items() if name.startswith(fragment)]
    run = _run(getattr(EP, plant)(), prop)
    verdict = LP.verdict_of(prop, run)
    assert not verdict.passed and verdict.name.startswith(fragment)
    assert "LayerCase(" in run.reproduce  # the shrunk case, printed as the Python that rebuilds it


def test_the_value_plants_pass_the_fixed_grids_they_escaped():
    """At the grids' exact scale 12/8 the rounded scale is exact, and in bf16 the 16-bit delta is inside tolerance."""
    shape = P.BlockShape("tiny", 48, 40, 16, 76)
    for plant, dtype in (("scale_rounded_bf16", torch.float32), ("merge_delta_bf16", torch.bfloat16)):
        impl = getattr(EP, plant)()
        spec = AdapterSpec(P.PROBE_TARGETS, 8, 12.0, False, torch.float32)
        probe = P.build_probe(impl, shape, spec, dtype, "cpu", seed=3)
        inputs = P.random_inputs(shape, (2, 5), dtype, "cpu", seed=4)
        got, errs = L.parity_errors(probe, inputs)
        assert all(e.ok for e in errs) and L.merged(probe, inputs).passed, plant


def _case(**kw):
    base = dict(config="fp32", hidden=24, q_out=20, kv_out=12, intermediate=28, tokens=6, layout="3d", r=8)
    return LP.LayerCase(**{**base, "alpha": 7.3, "rslora": False, "bias": False, "seed": 5, **kw})


def test_the_edge_plants_pass_the_cases_they_escaped_and_fail_at_their_edge():
    """Each edge plant holds where the old draws looked (small r, non-square layers, a NaN on the input or the upstream
    gradient) and breaks at its edge (r above the tile, a square layer, a NaN in an adapter)."""
    cut, merge, cleaned = EP.rank_cut_at_tile(), EP.merge_oriented_by_shape(), EP.lora_input_grad_nan_to_num()
    assert LP.check_case(cut, _case(r=128)) == []
    assert [b.split(":")[0] for b in LP.check_case(cut, _case(r=200))] == ["function"]
    assert LP.check_case(merge, _case()) == []
    square = _case(hidden=24, q_out=24, kv_out=24, intermediate=24)
    assert [b.split(":")[0] for b in LP.check_case(merge, square)] == ["merge"]
    for site in (("input", 0), ("upstream", 0)):
        LP.non_finite(cleaned, _case(), "cpu", math.nan, 3, site)  # the old cases: dy W keeps the NaN visible
    with pytest.raises(LP.Falsified, match=r"NaN in one element of adapter:.*lora_B.*dx: \d+ element\(s\) finite"):
        LP.non_finite(cleaned, _case(), "cpu", math.nan, 3, ("lora_B", 0))


@pytest.mark.parametrize("name", ["torch", "example"])
@pytest.mark.parametrize("kind", LP.SITE_KINDS)
@pytest.mark.parametrize("value", LP.POISONS)
def test_every_poison_site_holds_for_correct_stacks(name, kind, value):
    """The general non-finite property at every site kind and poison, for stacks that clean nothing (±Inf only where
    the path is linear: ``site_of`` draws from those)."""
    impl = EP._example().make() if name == "example" else resolve_implementation(name)
    for i in range(3):
        LP.non_finite(impl, _case(config="bf16", bias=True), "cpu", value, 7 * i + 1, (kind, i))


def test_a_drawn_case_reruns_from_its_printed_form():
    impl = EP.scale_rounded_bf16()
    case = LP.LayerCase("fp32", 3, 2, 2, 3, 2, "2d", 3, 7.3, False, True, 1)
    assert eval(repr(case), {"LayerCase": LP.LayerCase}) == case
    broken = LP.check_case(impl, case)
    assert broken and broken[0].startswith("function: s = 2.43")
    assert LP.check_case(EP._example().make(), case) == []


def test_an_fp16_case_beyond_the_dtype_range_is_not_judged():
    impl = resolve_implementation("torch")
    case = LP.LayerCase("fp16", 8, 8, 8, 8, 4, "2d", 1, 1e9, False, False, 0)
    probe = P.build_probe(impl, case.shape(), case.spec(), torch.float16, "cpu", seed=0)
    inputs = P.random_inputs(case.shape(), (4,), torch.float16, "cpu")
    assert not LP.in_range(probe, inputs)


def test_ulp_is_the_spacing_of_the_dtype():
    v = torch.tensor([1.0, 1.5, 0.0, -3.0], dtype=torch.float64)
    assert MR.ulp(v, torch.bfloat16).tolist()[:2] == [2.0**-7, 2.0**-7]
    assert MR.ulp(v, torch.float32).tolist()[0] == 2.0**-23
    assert MR.ulp(v, torch.bfloat16).tolist()[2] == 2.0**-133  # bf16's subnormal spacing
    assert MR.ulp(v, torch.float16).tolist()[3] == 2.0**-9


def test_the_hypothesis_profile_is_chosen_by_name(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert profile_name() == "ci" and suite_settings().derandomize
    monkeypatch.setenv(ENV, "nightly")
    assert not suite_settings().derandomize and suite_settings().max_examples > 100
    monkeypatch.setenv(ENV, "weekly")
    with pytest.raises(ValueError, match=r"LORA_SUITE_HYPOTHESIS_PROFILE='weekly' is not a profile; expected one of"):
        profile_name()


def test_the_cancellation_floor_leaves_random_grids_as_they_were():
    """For unit-variance terms the floor Σ|t|/√k stays below max|ref|: the grids' normalisation is unchanged."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 512, generator=gen).double(), torch.randn(256, 512, generator=gen).double()
    from lora_suite.judges.parity import cancellation_floor

    assert cancellation_floor(x.abs() @ w.abs().T, 512) < float((x @ w.T).abs().max())
    assert cancellation_floor(torch.tensor([[3.0]]), 1) == 3.0 and not math.isnan(cancellation_floor(x, 1))
