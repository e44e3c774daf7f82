"""Per-module rank and alpha (PEFT's rank_pattern and alpha_pattern, ``AdapterSpec.rank_pattern``/``alpha_pattern``)
on the CPU: the settings refuse malformed entries, correct stacks take a layer's own r and alpha through the layer
properties and the round trip (PEFT's loader reading the folder with each layer's own scale), a folder whose
patterns are not the model's is refused, and the two plants of the class fail the check their table row names while
passing the checks of a model without patterns."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lora_suite.engine.models import build_model
from lora_suite.engine.prepare import DTYPES, adapter_spec, prepare
from lora_suite.implementations import AdapterSpec, ImplementationError, resolve_implementation
from lora_suite.judges import layer_properties as LP
from lora_suite.judges import peft_folder as PF
from lora_suite.judges import round_trip as RT
from lora_suite.scenarios import example_plants as EP
from lora_suite.settings.config import SettingsError

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")

CASE = LP.LayerCase("fp32", 24, 20, 12, 28, 6, "3d", 5, 7.3, False, False, 5)


def _impl(name):
    return (
        EP._example().make()
        if name == "example"
        else getattr(EP, name)()
        if name in EP.__dict__
        else resolve_implementation(name)
    )


@pytest.mark.parametrize(
    "field, entry",
    [("rank_pattern", "v_proj=0"), ("rank_pattern", "v_proj"), ("rank_pattern", "=4"), ("alpha_pattern", "v_proj=inf")],
)
def test_malformed_pattern_entries_are_refused_naming_them(field, entry):
    with pytest.raises(SettingsError, match=rf"AdapterSpec.{field}: \['{entry}'\]; expected entries"):
        AdapterSpec(**{field: (entry,)})


def _round_trip(impl, cfg, tmp_path) -> list[str]:
    lora = dataclasses.replace(
        cfg.lora, targets=("q_proj", "v_proj"), rank_pattern=("v_proj=7",), alpha_pattern=("v_proj=7.3",)
    )
    cfg = dataclasses.replace(cfg, dtype="float32", lora=lora)
    trained = prepare(cfg, "cpu", implementation=impl)
    RT.train_a_few(trained, 3, 1e-2)
    folder = tmp_path / "adapter"
    verdicts = RT.round_trip(
        trained, lambda: prepare(cfg, "cpu", implementation=impl), folder, tampered=("lora_alpha",)
    )
    base = lambda: build_model(cfg.model, cfg.weights, DTYPES[cfg.dtype], "cpu", seed=cfg.train.seed).model  # noqa: E731
    verdicts += PF.peft_loader(trained, base, folder, adapter_spec(cfg, None))
    return [v.name for v in verdicts if not v.passed]


@pytest.mark.parametrize("name", ["peft", "example", "loralib"])
def test_correct_stacks_take_a_layers_own_rank_and_alpha(name, tiny_cfg, tmp_path):
    impl = _impl(name)
    assert LP.check_case(impl, dataclasses.replace(CASE, pattern=True)) == []
    assert _round_trip(impl, tiny_cfg, tmp_path) == []


@pytest.mark.parametrize("name", ["peft", "example"])
def test_a_folder_whose_patterns_are_not_the_models_is_refused(name, tiny_cfg, tmp_path):
    impl = _impl(name)
    cfg = dataclasses.replace(tiny_cfg, dtype="float32")
    trained = prepare(cfg, "cpu", implementation=impl)
    impl.save_adapter(trained.model, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    config["alpha_pattern"] = {cfg.lora.targets[-1]: 3.3}
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises((ImplementationError, ValueError), match="alpha_pattern"):
        impl.load_adapter(prepare(cfg, "cpu", implementation=impl).model, tmp_path / "a")


def test_alpha_pattern_ignored_fails_only_the_cases_with_a_pattern():
    impl = EP.alpha_pattern_ignored()
    assert LP.check_case(impl, CASE) == []
    assert [b.split(":")[0] for b in LP.check_case(impl, dataclasses.replace(CASE, pattern=True))] == [
        "function",
        "merge",
    ]


def test_patterns_not_saved_passes_its_own_round_trip_and_fails_peft_loader(tiny_cfg, tmp_path):
    (fragment,) = [frag for name, _, frag in EP.PLANTS.values() if name == "patterns_not_saved"]
    failed = _round_trip(EP.patterns_not_saved(), tiny_cfg, tmp_path)
    assert failed and all(f.startswith("PEFT's loader") for f in failed), failed
    assert fragment.removeprefix("per-module rank and alpha: ") in failed[0]
