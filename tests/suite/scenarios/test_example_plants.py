"""The shipped example implementation passes the layer checks and the adapter round trip on the CPU, and each of its
planted defects that the CPU can show (``lora_suite.scenarios.example_plants``) fails the check that exists for it.
(The GPU memory leak is caught by the extended tier on a GPU: selftest-gpu's test_planted_example_defects.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lora_suite.engine import probes as P
from lora_suite.engine.prepare import prepare, targets_left_out
from lora_suite.implementations import AdapterSpec
from lora_suite.judges import broken_folders as BF
from lora_suite.judges import layer_checks as L
from lora_suite.judges import probe_judge as PJ
from lora_suite.judges import round_trip as RT
from lora_suite.scenarios import example_plants as EP

SHAPE = P.BlockShape("tiny", 48, 40, 16, 76)


def _probe(impl, dtype=torch.float32, seed=0):
    spec = AdapterSpec(P.PROBE_TARGETS, 4, 8.0, adapter_dtype=dtype)
    return P.build_probe(impl, SHAPE, spec, dtype, "cpu", seed=seed), P.random_inputs(SHAPE, (2, 5), dtype, "cpu")


def _parity(impl, dtype=torch.float32):
    probe, inputs = _probe(impl, dtype)
    got, errs = L.parity_errors(probe, inputs)
    return L.parity_verdicts("cpu", [("tiny", errs, PJ.dtype_errors(probe, inputs, got))])


def _failed(verdicts):
    return [v.name for v in verdicts if not v.passed]


def _round_trip(impl, tiny_cfg, tmp_path):
    cfg = dataclasses.replace(tiny_cfg, dtype="float32")
    trained = prepare(cfg, "cpu", implementation=impl)
    RT.train_a_few(trained, 3, 1e-2)
    return RT.round_trip(trained, lambda: prepare(cfg, "cpu", implementation=impl), tmp_path / "adapter")


def test_the_example_passes_every_layer_check_and_the_round_trip(tiny_cfg, tmp_path):
    ex = EP._example().make()
    assert _failed(_parity(ex)) == []
    assert _failed(_parity(ex, torch.bfloat16)) == []
    probe, inputs = _probe(ex)
    checks = [L.determinism, L.eval_mode, L.accumulation, L.no_input_gradient, L.nan_rows, L.merged]
    assert _failed([c(probe, inputs) for c in checks]) == []
    assert _failed(_round_trip(ex, tiny_cfg, tmp_path)) == []


@pytest.mark.parametrize(
    "plant, fragment",
    [
        ("scale_twice", "outputs beyond tolerance"),
        ("frozen_lora_b", "dB beyond tolerance"),
        ("input_grad_dropped", "input gradients beyond tolerance"),
        ("output_upcast_fp32", "wrong dtype"),
    ],
)
def test_a_planted_layer_defect_fails_the_parity_grid(plant, fragment):
    failed = _failed(_parity(getattr(EP, plant)(), torch.bfloat16))
    assert any(fragment in f for f in failed), failed


def test_a_planted_eval_mode_defect_fails_the_eval_check():
    assert not L.eval_mode(*_probe(EP.eval_skips_adapters())).passed


def test_planted_nondeterminism_fails_determinism_and_passes_parity():
    impl = EP.nondeterministic_forward()
    assert _failed(_parity(impl, torch.bfloat16)) == []  # 2^-10 jitter is inside bf16's tolerance
    assert not L.determinism(*_probe(impl, torch.bfloat16)).passed


@pytest.mark.parametrize(
    "plant, fragment",
    [("save_drops_lora_b", "saved folder"), ("load_ignores_alpha", "wrong lora_alpha")],
)
def test_a_planted_save_or_load_defect_fails_the_round_trip(plant, fragment, tiny_cfg, tmp_path):
    failed = _failed(_round_trip(getattr(EP, plant)(), tiny_cfg, tmp_path))
    assert any(fragment in f for f in failed), failed


def test_a_target_left_out_is_named(tiny_cfg):
    prepared = prepare(tiny_cfg, "cpu", implementation=EP.target_left_out())
    left = targets_left_out(prepared.model, tiny_cfg.lora.targets, prepared.replaced)
    assert left and all(p.endswith("v_proj") for p in left), left
    clean = prepare(tiny_cfg, "cpu", implementation=EP._example().make())
    assert targets_left_out(clean.model, tiny_cfg.lora.targets, clean.replaced) == []


@pytest.mark.parametrize("name", ["torch", "peft"])
def test_builtins_pass_the_probe_checks_on_the_cpu(name):
    pytest.importorskip("peft") if name == "peft" else None
    from lora_suite.implementations import resolve_implementation

    impl = resolve_implementation(name)
    assert _failed(_parity(impl)) == []
    probe, inputs = _probe(impl)
    assert _failed([L.determinism(probe, inputs), L.eval_mode(probe, inputs), L.merged(probe, inputs)]) == []


@pytest.mark.parametrize("what", list(BF.BROKEN))
def test_the_example_refuses_a_folder_whose_weights_do_not_fit_and_a_lenient_loader_does_not(what, tiny_cfg, tmp_path):
    cfg = dataclasses.replace(tiny_cfg, dtype="float32")

    def verdict(impl):
        trained = prepare(cfg, "cpu", implementation=impl)
        return BF.broken_folder(trained, lambda: prepare(cfg, "cpu", implementation=impl), tmp_path / impl.name, what)

    assert verdict(EP._example().make()).passed
    lenient = EP.load_takes_what_fits()
    lenient.name = "lenient"
    v = verdict(lenient)
    assert not v.passed and v.name == f"folder with {what}: refused (never loaded in part)"


def test_a_loader_that_checks_only_the_pairs_it_finds_escapes_one_missing_tensor_and_not_a_missing_layer(
    tiny_cfg, tmp_path
):
    """The partial-folder class: a loader that refuses a lone A or B, an unknown tensor and a wrong shape, but loads
    whatever complete pairs the folder holds, is refused only by the folders that hold part of the layers."""
    cfg = dataclasses.replace(tiny_cfg, dtype="float32")
    impl = EP.load_takes_complete_pairs()
    passed = {}
    for i, what in enumerate(BF.BROKEN):
        trained = prepare(cfg, "cpu", implementation=impl)
        passed[what] = BF.broken_folder(
            trained, lambda: prepare(cfg, "cpu", implementation=impl), tmp_path / f"p{i}", what
        ).passed
    assert [w for w, ok in passed.items() if not ok] == [
        "one layer's adapters missing",
        "half the layers' adapters missing",
    ]


@pytest.mark.parametrize("name", ["torch", "peft"])
def test_the_builtins_refuse_a_folder_whose_weights_do_not_fit(name, tiny_cfg, tmp_path):
    pytest.importorskip("peft") if name == "peft" else None
    from lora_suite.implementations import resolve_implementation

    cfg = dataclasses.replace(tiny_cfg, dtype="float32")
    impl = resolve_implementation(name)
    for what in BF.BROKEN:
        trained = prepare(cfg, "cpu", implementation=impl)
        v = BF.broken_folder(
            trained,
            lambda: prepare(cfg, "cpu", implementation=impl),
            tmp_path / f"b{list(BF.BROKEN).index(what)}",
            what,
        )
        assert v.passed, (what, v.detail)


def test_selftest_gpu_runs_the_plants_it_is_told_and_refuses_unknown_names(monkeypatch):
    from lora_suite.tiers.selftest_gpu import test_planted_example_defects as T

    monkeypatch.delenv(T.ONLY, raising=False)
    assert T.chosen_plants() == EP.PLANTS
    monkeypatch.setenv(T.ONLY, "scale_rounded_bf16, merge_delta_bf16")
    assert sorted(v[0] for v in T.chosen_plants().values()) == ["merge_delta_bf16", "scale_rounded_bf16"]
    monkeypatch.setenv(T.ONLY, "scale_rounded_bf16,no_such_plant")
    with pytest.raises(ValueError, match=r"\['no_such_plant'\] are not plants; expected some of"):
        T.chosen_plants()
