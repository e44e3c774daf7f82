"""The architectures of ``lora_suite.engine.architectures`` and the whole-model criterion of
``lora_suite.judges.model_function`` on the CPU: each family builds offline, deterministic, with the traits it is
there for; the criterion passes for lora_core's torch backend, PEFT and the example on every family (or names why
not), and fails on the planted defects of the architecture class, which pass the layer checks of the bias-free probe."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lora_suite.engine import probes as P
from lora_suite.engine.architectures import ARCHITECTURES, NAMES
from lora_suite.implementations import AdapterSpec, resolve_implementation
from lora_suite.judges import invariant_checks as I
from lora_suite.judges import layer_checks as L
from lora_suite.judges import model_function as MF
from lora_suite.scenarios import example_plants as EP
from lora_suite.scenarios.example_plant_table import PLANTS

F32 = torch.float32


@pytest.mark.parametrize("name", NAMES)
def test_each_family_builds_offline_deterministic_with_its_traits(name):
    arch = ARCHITECTURES[name]
    one, two = arch.build(F32, "cpu", seed=3), arch.build(F32, "cpu", seed=3)
    params = dict(one.named_parameters())
    assert 50_000 < sum(p.numel() for p in params.values()) < 1_000_000
    assert all(torch.equal(p, q) for p, q in zip(params.values(), two.parameters()))
    assert not torch.equal(next(iter(params.values())), next(arch.build(F32, "cpu", seed=4).parameters()))
    leaves = {p.rsplit(".", 1)[-1] for p, m in one.named_modules() if isinstance(m, nn.Linear)}
    assert set(arch.targets) <= leaves, f"{name}: targets {arch.targets} not among its linears {leaves}"
    biases = {n.rsplit(".", 2)[-2]: p for n, p in params.items() if n.endswith(".bias")}
    assert set(biases) == set(arch.biased)
    assert all(bool((b != 0).all()) for b in biases.values()), "a bias left at zero would hide a dropped bias"
    tied = one.get_output_embeddings().weight is one.get_input_embeddings().weight
    assert tied == arch.tied
    experts = {n.rsplit(".", 1)[-1] for n, p in params.items() if p.dim() == 3}
    assert experts == set(arch.parameter_targets)
    assert arch.build(torch.bfloat16, "cpu", seed=3).get_input_embeddings().weight.dtype == torch.bfloat16


def test_the_families_carry_what_they_are_there_for():
    cfg = {n: a.config() for n, a in ARCHITECTURES.items()}
    assert cfg["gemma2"].final_logit_softcapping and cfg["gemma2"].attn_logit_softcapping
    assert (
        "q_norm" in dict(ARCHITECTURES["qwen3"].build(F32, "cpu").named_modules())["model.layers.0.self_attn"]._modules
    )
    assert {"qkv_proj", "gate_up_proj"} <= set(ARCHITECTURES["phi3"].targets)
    assert MF.SEQ > cfg["mistral"].sliding_window  # the window bites
    assert len(NAMES) >= 7


def _impls():
    return {
        "torch": resolve_implementation("torch"),
        "peft": resolve_implementation("peft"),
        "example": EP._example().make(),
    }


@pytest.mark.parametrize("impl_name", ["torch", "peft", "example"])
def test_the_correct_stacks_pass_on_every_family_or_say_why_not(impl_name):
    impl, judged = _impls()[impl_name], []
    for name, arch in ARCHITECTURES.items():
        why = MF.not_applicable_reason(impl, arch)
        if why:
            assert impl_name == "torch" and name == "phi3" and "qkv_proj" in why, (impl_name, name, why)
            continue
        verdicts = MF.judge(impl, arch, F32, "cpu")
        assert len(verdicts) == 6 and all(v.name.startswith(f"{name}: ") for v in verdicts)
        assert [v.name for v in verdicts if not v.passed] == [], (impl_name, name)
        judged.append(name)
        if arch.parameter_targets:  # PEFT and lora_core adapt the experts (judged with them); the example says why not
            assert (MF.expert_reason(impl, arch) is None) == (impl_name != "example"), (impl_name, name)
    assert len(judged) >= 6


def _failed(impl, name="qwen2") -> list[str]:
    return [v.name for v in MF.judge(impl, ARCHITECTURES[name], F32, "cpu") if not v.passed]


@pytest.mark.parametrize("plant", ["base_bias_dropped", "base_bias_left_trainable"])
def test_each_architecture_plant_fails_its_named_check_on_qwen2_and_passes_on_llama(plant):
    fragment = next(frag for factory, _, frag in PLANTS.values() if factory == plant)
    failed = _failed(getattr(EP, plant)())
    assert any(fragment in n for n in failed), (plant, fragment, failed)
    assert _failed(getattr(EP, plant)(), "llama") == []  # bias-free: the defect is invisible there


@pytest.mark.parametrize("plant", ["base_bias_dropped", "base_bias_left_trainable"])
def test_the_architecture_plants_pass_the_layer_checks_of_the_bias_free_probe(plant):
    shape = P.BlockShape("tiny", 48, 40, 16, 76)
    spec = AdapterSpec(P.PROBE_TARGETS, 4, 8.0, False, F32)

    def probe():
        return P.build_probe(getattr(EP, plant)(), shape, spec, F32, "cpu"), P.random_inputs(shape, (2, 5), F32, "cpu")

    got, errs = L.parity_errors(*probe())
    verdicts = L.parity_verdicts("tiny", [("tiny", errs, [])]) + [I.frozen_base(*probe()), L.determinism(*probe())]
    assert [v.name for v in verdicts if not v.passed] == []


def test_a_scale_applied_twice_moves_the_logits_and_gradients_on_every_family():
    """The criterion is not only about biases: the forward plant of the layer class fails it on a bias-free family."""
    failed = _failed(EP.scale_twice(), "phi3")
    assert "phi3: logits beyond tolerance of the float64 adapted model" in failed
    assert any(n.startswith("phi3: adapter gradients beyond tolerance") for n in failed)


def test_the_tolerance_is_fp32_level_and_named_in_the_verdict():
    case = MF.build_case(_impls()["torch"], ARCHITECTURES["llama"], F32, "cpu")
    assert 1e-6 < MF.model_tolerance(case) < 1e-3
    got, want = MF.run_model(case), MF.reference_run(case)
    err = float((got.logits.double() - want.logits).abs().max() / want.logits.abs().max())
    assert err < MF.model_tolerance(case) / 10  # a margin of ten: rounding, not a defect, sits well inside it


def test_the_quick_tier_test_records_each_family_or_its_reason(monkeypatch):
    """The quick tier's test, run on the CPU with a real run report: six checks per judged family and three more for
    the MoE's experts (routing, merge, round trip: lora_core adapts them), a family not applicable with the stack's
    own reason, one table row per judged family."""
    from types import SimpleNamespace

    from lora_suite.harness.checks import Checker
    from lora_suite.harness.report import RunReport
    from lora_suite.tiers.quick import test_architectures as T

    monkeypatch.setattr(T, "DEV", "cpu")
    report, impl = RunReport(run_id="r", selection="quick", environment=None), _impls()["torch"]
    for name in NAMES:
        request = SimpleNamespace(node=SimpleNamespace(nodeid=f"test_architectures.py::t[{name}]"))
        T.test_architecture_computes_the_adapted_base_function(name, impl, Checker(report, "t", []), report, request)
    assert len(report.checks) == 6 * (len(NAMES) - 1) + 3 and all(c.passed for c in report.checks)
    assert sum(c.name.startswith("qwen3_moe: expert adapters") for c in report.checks) == 2  # routing, round trip
    na = {n.name: n.reason for n in report.not_applicable}
    assert set(na) == {"phi3: every check of this architecture"}
    assert "qkv_proj" in na["phi3: every check of this architecture"]
    (table,) = report.series
    assert [row[0] for row in table.rows] == [n for n in NAMES if n != "phi3"]
