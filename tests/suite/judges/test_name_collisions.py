"""Module names that collide with the words of adapter keys (``lora_suite.judges.name_collisions``) on the CPU: correct
stacks keep each module's own adapters through the round trip, a stack that refuses such names is named in its own
words, and the two plants of the class fail the verdict their table row names while passing the round trip of the
tiny Llama (the names the earlier checks drew)."""

from __future__ import annotations

import dataclasses

import pytest

from lora_suite.engine.prepare import prepare
from lora_suite.implementations import resolve_implementation
from lora_suite.judges import name_collisions as NC
from lora_suite.judges import round_trip as RT
from lora_suite.scenarios import example_plants as EP

pytestmark = pytest.mark.usefixtures("one_thread")


def _impl(name):
    if name == "peft":
        pytest.importorskip("peft")
    return EP._example().make() if name == "example" else resolve_implementation(name)


@pytest.mark.parametrize("name", ["peft", "example", "loralib"])
def test_correct_stacks_keep_each_module_its_own_adapters(name):
    verdicts, refused = NC.name_collisions(_impl(name), "cpu")
    assert refused is None and len(verdicts) == 3
    assert [v.detail for v in verdicts if not v.passed] == []


def test_a_stack_that_refuses_such_names_is_named_in_its_own_words():
    verdicts, refused = NC.name_collisions(resolve_implementation("torch"), "cpu")
    assert verdicts == [] and refused.startswith("torch's inject refuses these names: targets ['weight'"), refused


@pytest.mark.parametrize("plant", ["trainable_by_substring", "load_keys_stripped_of_weight"])
def test_a_name_plant_fails_its_verdict_and_passed_the_round_trip_of_a_llama(plant, tiny_cfg, tmp_path):
    (fragment,) = [frag for name, _, frag in EP.PLANTS.values() if name == plant]
    verdicts, _ = NC.name_collisions(getattr(EP, plant)(), "cpu")
    failed = [v.name for v in verdicts if not v.passed]
    assert len(failed) == 1 and fragment in failed[0], failed
    cfg = dataclasses.replace(tiny_cfg, dtype="float32")
    impl = getattr(EP, plant)()
    trained = prepare(cfg, "cpu", implementation=impl)
    RT.train_a_few(trained, 3, 1e-2)
    round_trip = RT.round_trip(trained, lambda: prepare(cfg, "cpu", implementation=impl), tmp_path / "adapter")
    assert [v.name for v in round_trip if not v.passed] == []
