"""The lifecycle's combination rule (``lifecycle_ops.combine``) on the CPU: PEFT's add_weighted_adapter passes it
after rescales, training and switches, under rsLoRA too; a combination that reads each source's scale from its
config instead of the layer's current one (a rescale's factor lost), one that leaves the new adapter active, one that
scales the active source's B in place, and one that inherits rsLoRA (PEFT 0.21) each break it, with a shrunk
sequence that holds the combination."""

from __future__ import annotations

import pytest
import torch

from lora_suite.engine import probes as P
from lora_suite.implementations import AdapterSpec
from lora_suite.implementations.peft_impl import PeftImplementation
from lora_suite.judges import lifecycle as LC
from tests.suite.judges.test_combined_adapters import InheritsRslora, SourceRescaled

pytestmark = pytest.mark.usefixtures("one_thread")
SHAPE = P.BlockShape("tiny", 48, 40, 16, 76)
SPEC = AdapterSpec(P.PROBE_TARGETS, 4, 12.0, False, torch.float32)


class ScaleFromConfig(PeftImplementation):
    """Combines with sᵢ = alpha/r of each source's config: a ``set_adapter_scale`` factor dropped."""

    name = expected_path = "peft"

    def combine_adapters(self, model, names, weights, new):
        layers = list(self._lora_layers(model))
        now = [dict(m.scaling) for m in layers]
        for m in layers:
            for a in names:
                m.scaling[a] = m.lora_alpha[a] / m.r[a]
        try:
            super().combine_adapters(model, names, weights, new)
        finally:
            for m, scaling in zip(layers, now):
                m.scaling.update(scaling)


class LeavesNewActive(PeftImplementation):
    name = expected_path = "peft"

    def combine_adapters(self, model, names, weights, new):
        super().combine_adapters(model, names, weights, new)
        for m in self._lora_layers(model):
            m.set_adapter(new)


# the combination that rescales its first source's B in place (here the active adapter)
ScalesActiveSource = SourceRescaled


def _run(impl, spec=SPEC):
    pytest.importorskip("peft")
    return LC.run_lifecycle(impl, SHAPE, spec, torch.float32, "cpu")


@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
def test_peft_combines_within_the_lifecycle(rslora):
    """Under rsLoRA too, as quick's fp32 lifecycle runs it: PEFT 0.22 gives the combined adapter a scale of 1 (PEFT
    0.21 inherited rsLoRA: r/√r, caught on an H100 by this rule, run 20261208T003657Z-quick-peft)."""
    import dataclasses

    v = _run(PeftImplementation(), dataclasses.replace(SPEC, use_rslora=rslora))
    assert v.passed, v.detail


@pytest.mark.parametrize(
    "plant", [ScaleFromConfig, LeavesNewActive, ScalesActiveSource, InheritsRslora], ids=lambda c: c.__name__
)
def test_a_planted_combination_breaks_the_lifecycle_with_its_sequence(plant):
    import dataclasses

    v = _run(plant(), dataclasses.replace(SPEC, use_rslora=plant is InheritsRslora))
    assert not v.passed, f"{plant.__name__} passed the lifecycle"
    assert "state.combine_adapters(" in v.detail or "combine_adapters(w=" in v.detail, v.detail
