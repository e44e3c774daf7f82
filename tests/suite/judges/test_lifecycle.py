"""The adapter lifecycle (``lora_suite.judges.lifecycle``) on the CPU under the derandomised profile: the torch
reference implementation, PEFT and the shipped example keep the float64 function of their current adapters through
every rule sequence drawn (each rule reached); each planted state defect of ``example_plants_state`` breaks it, with
the shrunk sequence in the verdict's detail (which ``replay`` reproduces), and passes every check that existed
before it."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from lora_suite.engine import probes as P
from lora_suite.engine.prepare import prepare
from lora_suite.implementations import AdapterSpec, LoRAImplementation, resolve_implementation
from lora_suite.implementations.peft_impl import PeftImplementation
from lora_suite.judges import layer_checks as L
from lora_suite.judges import lifecycle as LC
from lora_suite.judges import probe_judge as PJ
from lora_suite.judges import round_trip as RT
from lora_suite.scenarios import example_plants as EP
from tests.suite.judges.test_invariant_checks import invariant_verdicts

SHAPE = P.BlockShape("tiny-bias", 48, 40, 16, 76, bias=True)  # base biases: judged kept and frozen through every rule
PLAIN = P.BlockShape("tiny", 48, 40, 16, 76)  # the shape the earlier checks' CPU tests use
F32, BF16 = torch.float32, torch.bfloat16
SPEC = AdapterSpec(P.PROBE_TARGETS, 4, 12.0, False, F32)  # s = 3: not a power of two
RULES = {
    "save_at_start",
    "train_step",
    "forward",
    "set_mode",
    "two_forwards_one_backward",
    "checkpointed_forward",
    "rewrite_adapters",
    "merge",
    "save",
    "load_saved_adapter",
    "load into the fresh model",
    "load into the same model",
    "cast_to_other_dtype",
    "unmerge",
    "disabled_forward",
    "rescale",
    "add_adapter",
    "switch_adapter",
    "delete_adapter",
    "combine_adapters",
}
# operation -> its rules
OP_RULES = {
    "unmerge": ("unmerge",),
    "disable": ("disabled_forward",),
    "rescale": ("rescale",),
    "adapters": ("add_adapter", "switch_adapter", "delete_adapter", "combine_adapters"),
    "combine": ("combine_adapters",),
}
# plant -> the rule its shrunk sequence must hold (the state it leaves stale)
STATE_PLANTS = {
    "inference_weight_cached": ("state.train_step(", "state.rewrite_adapters(", "state.rescale("),
    "merge_kept_in_eval": ("state.merge()",),
    "inference_cast_cache_kept_over_to": ("state.cast_to_other_dtype()",),
    "unmerge_leaves_delta": ("state.unmerge()",),
    "disable_not_restored_on_error": ("state.disabled_forward(raise_inside=True)",),
    "rescale_ignores_rslora": ("state.rescale(",),
    "rescale_compounds": ("state.rescale(",),
}
RSLORA = AdapterSpec(P.PROBE_TARGETS, 4, 12.0, True, F32)  # s = 6 = 12/√4: the rescale under rsLoRA differs from 3
SPEC_OF = {"rescale_ignores_rslora": RSLORA}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/suite/engine/conftest.py


def _impl(name: str) -> LoRAImplementation:
    if name == "example":
        return EP._example().make()
    if name == "peft":
        pytest.importorskip("peft")
    return resolve_implementation(name) if name in ("torch", "peft") else getattr(EP, name)()


@pytest.mark.parametrize("dtype", [F32, BF16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", ["torch", "peft", "example"])
def test_correct_stacks_keep_the_function_of_their_current_adapters(name, dtype):
    """In the quick tier's two parts (tiers/quick/test_adapter_lifecycle.py PARTS): each passes, and together they
    reach every rule."""
    ran: Counter = Counter()
    impl = _impl(name)
    spec = SPEC if dtype == F32 else dataclasses.replace(SPEC, alpha=7.3)  # s = 7.3/4: not exact in 16 bits
    for k in range(2):
        v = LC.run_lifecycle(impl, SHAPE, spec, dtype, "cpu", ran=ran, part=(k, 2))
        assert v.passed, v.detail
        assert v.name.startswith(f"{str(dtype)[6:]}: adapter lifecycle: rule sequences whose model left")
        assert v.name.endswith(f", part {k + 1} of 2)"), v.name
    offered = RULES - {rule for op, rules in OP_RULES.items() if impl.operation_reason(op) for rule in rules}
    offered -= {"cast_to_other_dtype"} if dtype not in LC.PARTNER else set()
    assert set(ran) == offered, f"rules never reached: {offered - set(ran)}, or reached though not offered"


def test_the_parts_draw_different_sequences_and_a_bad_part_is_refused():
    seen = []
    for k in range(2):
        ran: Counter = Counter()
        LC.run_lifecycle(_impl("torch"), SHAPE, SPEC, F32, "cpu", ran=ran, part=(k, 2))
        seen.append(ran)
    assert seen[0] != seen[1]
    with pytest.raises(ValueError, match=r"part=\(2, 2\)"):
        LC.run_lifecycle(_impl("torch"), SHAPE, SPEC, F32, "cpu", part=(2, 2))


@pytest.mark.parametrize("plant", list(STATE_PLANTS))
def test_a_state_plant_breaks_the_lifecycle_with_its_shrunk_sequence(plant):
    (fragment,) = [frag for name, _, frag in EP.PLANTS.values() if name == plant]
    impl, spec = _impl(plant), SPEC_OF.get(plant, SPEC)
    v = LC.run_lifecycle(impl, SHAPE, spec, F32, "cpu")
    assert not v.passed and fragment in v.name, v
    program = v.detail.split("shrunk sequence", 1)[1]
    assert "state = AdapterLifecycle()" in program and "LifecycleBroken" in v.detail, v.detail
    assert any(rule in program for rule in STATE_PLANTS[plant]), v.detail
    steps = [line for line in program.splitlines() if line.startswith("state.") and "check()" not in line]
    assert 1 <= len(steps) <= 4, v.detail  # shrunk: the few rules that leave the state stale
    with pytest.raises(LC.LifecycleBroken):
        LC.replay(LC.Build(impl, SHAPE, spec, F32, "cpu"), program)


def _existing_checks(impl, tiny_cfg, tmp_path) -> list:
    """The checks that judged the example before the lifecycle: the invariants, the probe checks of
    ``tests/suite/scenarios/test_example_plants.py`` and the adapter round trip."""
    out = invariant_verdicts(impl)
    for dtype in (F32, BF16):
        spec = AdapterSpec(P.PROBE_TARGETS, 4, 8.0, adapter_dtype=dtype)
        probe, inputs = P.build_probe(impl, PLAIN, spec, dtype, "cpu"), P.random_inputs(PLAIN, (2, 5), dtype, "cpu")
        got, errs = L.parity_errors(probe, inputs)
        out += L.parity_verdicts("cpu", [("tiny", errs, PJ.dtype_errors(probe, inputs, got))])
    spec = AdapterSpec(P.PROBE_TARGETS, 4, 8.0, adapter_dtype=F32)
    probe, inputs = P.build_probe(impl, PLAIN, spec, F32, "cpu"), P.random_inputs(PLAIN, (2, 5), F32, "cpu")
    for check in (L.determinism, L.eval_mode, L.accumulation, L.no_input_gradient, L.nan_rows, L.merged):
        out.append(check(probe, inputs))
    cfg = dataclasses.replace(tiny_cfg, dtype="float32")
    trained = prepare(cfg, "cpu", implementation=impl)
    RT.train_a_few(trained, 3, 1e-2)
    return out + RT.round_trip(trained, lambda: prepare(cfg, "cpu", implementation=impl), tmp_path / "adapter")


@pytest.mark.parametrize("plant", list(STATE_PLANTS))
def test_a_state_plant_passes_every_check_that_judges_one_call(plant, tiny_cfg, tmp_path):
    verdicts = _existing_checks(_impl(plant), tiny_cfg, tmp_path)
    assert len(verdicts) > 40
    assert [v.name for v in verdicts if not v.passed] == []


def test_the_merge_rule_is_left_out_where_the_implementation_has_no_merge():
    impl = EP._planted("no_merge", merge_adapters=LoRAImplementation.merge_adapters)
    assert impl.merge_reason() is not None
    ran: Counter = Counter()
    v = LC.run_lifecycle(impl, SHAPE, SPEC, F32, "cpu", ran=ran)
    assert v.passed, v.detail
    assert "merge" not in ran and ran["train_step"] > 0, ran


def test_a_crash_inside_a_rule_is_a_failure_naming_the_error():
    """A load that raises on the folder its own save wrote is a broken lifecycle (the stack's error, named), shrunk to
    the checkpoint every sequence starts with and one load."""

    def load_adapter(self, model, path):
        raise RuntimeError(f"cannot read {path}")

    v = LC.run_lifecycle(EP._planted("load_raises", load_adapter=load_adapter), SHAPE, SPEC, F32, "cpu")
    assert not v.passed and "RuntimeError: cannot read" in v.detail, v.detail
    steps = [line for line in v.detail.splitlines() if line.startswith("state.") and "check()" not in line]
    assert steps[0] == "state.save_at_start()" and steps[-2:] == [
        "state.load_saved_adapter(into='fresh model')",
        "state.teardown()",
    ], steps
    assert len(steps) <= 4, steps  # shrunk: the checkpoint, at most one rule before the load, the load


class SwitchLeavesTheOldAdapterTrainable(PeftImplementation):
    """set_active_adapter that points every layer at the new adapter (PEFT's ``_active_adapter``) without PEFT's
    requires_grad bookkeeping: the adapter switched away from stays trainable, so an optimizer built over the model's
    trainable parameters trains it too."""

    name = expected_path = "peft"

    def set_active_adapter(self, model, name):
        for m in self._lora_layers(model):
            m._active_adapter = name
            for which in (m.lora_A, m.lora_B):
                which[name].requires_grad_(True)


def test_an_adapter_switch_that_leaves_the_old_adapter_trainable_breaks_the_lifecycle():
    pytest.importorskip("peft")
    v = LC.run_lifecycle(SwitchLeavesTheOldAdapterTrainable(), SHAPE, SPEC, F32, "cpu")
    assert (
        not v.passed
        and "trainable" in v.detail
        and ("state.switch_adapter(" in v.detail or "state.add_adapter(" in v.detail)
    ), v.detail
    assert LC.run_lifecycle(PeftImplementation(), SHAPE, SPEC, F32, "cpu").passed
