"""The layer invariants of ``lora_suite.judges.invariant_checks`` on the CPU: the shipped example passes each of them
(and the scale grids of ``tiers/quick/test_layer_invariants.py``), and each planted defect of
``lora_suite.scenarios.example_plants`` fails exactly the check ``PLANTS`` names for it."""

from __future__ import annotations

import pytest
import torch

from lora_suite.engine import probes as P
from lora_suite.implementations import AdapterSpec, resolve_implementation
from lora_suite.judges import invariant_checks as I
from lora_suite.judges import layer_checks as L
from lora_suite.judges import probe_judge as PJ
from lora_suite.scenarios import example_plants as EP

SHAPE = P.BlockShape("tiny", 48, 40, 16, 76)
F32, BF16 = torch.float32, torch.bfloat16
SCALINGS = {"scale alpha/r=12/8": (8, 12.0, False), "rsLoRA alpha/sqrt(r)=12/4": (16, 12.0, True)}


def _probe(impl, dtype=F32, *, r=4, alpha=8.0, rslora=False, adapter_dtype=F32, seed=0, randomise=True):
    spec = AdapterSpec(P.PROBE_TARGETS, r, alpha, rslora, adapter_dtype)
    probe = P.build_probe(impl, SHAPE, spec, dtype, "cpu", seed=seed, randomise=randomise)
    return probe, P.random_inputs(SHAPE, (2, 5), dtype, "cpu", seed=seed + 1)


def invariant_verdicts(impl) -> list:
    """Every verdict the quick tier's invariant tests record, on the CPU at tiny shapes (names as on the GPU)."""
    out = [
        I.initial_outputs(*_probe(impl, randomise=False)),
        I.initial_gradients(*_probe(impl, BF16, randomise=False)),
        I.adapter_dtypes(_probe(impl, BF16, adapter_dtype=F32)[0]),
        I.adapter_dtypes(_probe(impl, BF16, adapter_dtype=BF16)[0]),
        I.frozen_base(*_probe(impl)),
        I.unmatched_targets(impl, SHAPE, AdapterSpec(P.PROBE_TARGETS, 4, 8.0, False, F32), F32, "cpu"),
        I.inputs_untouched(*_probe(impl)),
        I.several_forwards(*_probe(impl), P.random_inputs(SHAPE, (2, 5), F32, "cpu", seed=55)),
        I.checkpointed(*_probe(impl), False),
        I.checkpointed(*_probe(impl), True),
    ]
    for label, (r, alpha, rslora) in SCALINGS.items():
        probe, inputs = _probe(impl, r=r, alpha=alpha, rslora=rslora)
        got, errs = L.parity_errors(probe, inputs)
        out += L.parity_verdicts(label, [("tiny", errs, PJ.dtype_errors(probe, inputs, got))])
        v = L.merged(*_probe(impl, r=r, alpha=alpha, rslora=rslora, seed=7))
        out.append(type(v)(f"{label}: {v.name}", v.value, v.op, v.threshold, v.source, v.detail))
    probe, inputs = _probe(impl, seed=3)
    out += [L.merged(probe, inputs), I.merge_folds(probe, inputs)]
    return out


def _failed(verdicts) -> list[str]:
    return [v.name for v in verdicts if not v.passed]


def test_the_example_passes_every_invariant():
    verdicts = invariant_verdicts(EP._example().make())
    assert len(verdicts) == 24
    assert _failed(verdicts) == []


PROBE_PLANTS = [
    "lora_b_random_init",
    "lora_a_zero_init",
    "rslora_ignored",
    "scale_integer_division",
    "adapter_dtype_ignored",
    "base_left_trainable",
    "input_clipped_in_place",
    "input_kept_on_the_layer",
    "merge_ignores_rslora",
    "merge_folds_nothing",
    "inject_accepts_unmatched_targets",
]


@pytest.mark.parametrize("factory", PROBE_PLANTS)
def test_each_planted_defect_fails_the_check_it_names(factory):
    (fragment,) = [frag for name, _, frag in EP.PLANTS.values() if name == factory]
    failed = _failed(invariant_verdicts(getattr(EP, factory)()))
    assert any(fragment in name for name in failed), (fragment, failed)


def test_a_random_b_too_small_for_the_bf16_grid_still_fails_the_initial_state():
    """B at std 1e-3 moves bf16 outputs by less than their parity tolerance: fp32 activations show it."""
    impl = EP.lora_b_random_init()
    probe, inputs = _probe(impl, BF16, adapter_dtype=BF16, randomise=False)
    assert I.initial_outputs(probe, inputs).passed  # blind in bf16: why the tier judges it in fp32
    assert not I.initial_outputs(*_probe(impl, randomise=False)).passed


def test_the_kept_input_plant_passes_the_parity_grid_alone():
    """One forward per backward: the plant's gradients are right, only a second forward shows the defect."""
    probe, inputs = _probe(EP.input_kept_on_the_layer())
    got, errs = L.parity_errors(probe, inputs)
    assert _failed(L.parity_verdicts("one", [("tiny", errs, [])])) == []


@pytest.mark.parametrize("plant", ["", "settings_kept_on_the_implementation", "served_by_kept_on_the_implementation"])
def test_two_models_keep_their_own_state(plant, tmp_path):
    """Issue 55: state kept on the implementation object (4 surviving value mutants of the example) is caught; the
    example as shipped, the torch reference and PEFT pass."""
    from lora_suite.implementations.lookup import resolve_implementation
    from lora_suite.judges.two_models import two_models

    impls = [getattr(EP, plant)()] if plant else [EP._example().make(), resolve_implementation("torch")]
    if not plant:
        impls.append(resolve_implementation("peft"))
    for i, impl in enumerate(impls):
        v = two_models(impl, SHAPE, F32, "cpu", tmp_path / str(i))
        assert v.passed != bool(plant), (impl.name, v.detail)


def test_the_init_spread_holds_for_correct_stacks_and_fails_a_forgotten_a_and_a_nudged_one():
    """PEFT's default init (A U(±1/√in), B 0) for the torch reference, PEFT and the example; the plant that forgets
    a=√5 (√6 times the spread) and a stack whose a is √6 (7% narrower: a mutant that survived before) both fail it."""
    import math

    from lora_suite.judges import init_spread as IS

    for impl in (resolve_implementation("torch"), resolve_implementation("peft"), EP._example().make()):
        v = IS.initial_spread(impl, "cpu")
        assert v.passed, (impl.name, v.detail)
    assert "max|A|·√in" in IS.initial_spread(EP.lora_a_init_spread(), "cpu").detail

    def nudged(layer, example_init, *args):
        example_init(*args)
        with torch.no_grad():
            torch.nn.init.kaiming_uniform_(layer.lora_A, a=math.sqrt(6))

    v = IS.initial_spread(EP._layer_init_then("nudged", nudged), "cpu")
    assert not v.passed and "std of A·√in" in v.detail, v.detail
