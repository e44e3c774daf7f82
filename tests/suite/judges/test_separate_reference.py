"""The architecture checks' float64 reference in a fresh process (``lora_suite.judges.separate_reference``), on the
CPU: a stack that patches transformers for the whole process with code that takes no float64 (as Liger's Triton
RMSNorm and Unsloth's rewritten model code do) breaks the in-process reference and is judged on every family through
the separate one; the separate reference is the in-process one's numbers; a wrong stack still fails it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lora_suite.engine.architectures import ARCHITECTURES
from lora_suite.implementations import resolve_implementation
from lora_suite.implementations.lora_core_impl import LoraCoreImplementation
from lora_suite.judges import model_function as MF
from lora_suite.judges import separate_reference as SR

pytestmark = pytest.mark.usefixtures("one_thread")


class Patching(LoraCoreImplementation):
    """lora_core on torch ops, whose inject patches every RMSNorm class of transformers in place, for the process, with
    a forward that refuses float64 (computing the stack's own fp32 model exactly as before)."""

    def __init__(self, separate: bool, monkeypatch, scale: float = 1.0):
        super().__init__("torch")
        self.separate_reference, self.monkeypatch, self.factor = separate, monkeypatch, scale

    def inject(self, model, spec):
        out = super().inject(model, spec)
        for m in model.modules():
            cls = type(m)
            if cls.__name__.endswith("RMSNorm") and "forward" in vars(cls) and not hasattr(cls, "_patched"):
                own = vars(cls)["forward"]

                def forward(self, x, _own=own):
                    if x.dtype == torch.float64:
                        raise TypeError("Expected a Float32, BFloat16 or Float16 matrix, got Double")
                    return _own(self, x)

                self.monkeypatch.setattr(cls, "forward", forward)
                self.monkeypatch.setattr(cls, "_patched", True, raising=False)
        if self.factor != 1.0:
            for m in model.modules():
                if hasattr(m, "scale") and hasattr(m, "lora_A"):
                    m.scale *= self.factor
        return out


def _failed(impl, name):
    return [v.name for v in MF.judge(impl, ARCHITECTURES[name], torch.float32, "cpu") if not v.passed]


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_a_process_wide_patch_breaks_the_in_process_reference_and_the_separate_one_judges(name, monkeypatch):
    with pytest.raises(TypeError, match="got Double"):
        MF.judge(Patching(False, monkeypatch), ARCHITECTURES[name], torch.float32, "cpu")
    assert _failed(Patching(True, monkeypatch), name) == []


def test_the_separate_reference_is_the_in_process_reference():
    case = MF.build_case(resolve_implementation("torch"), ARCHITECTURES["qwen3_moe"], torch.float32, "cpu")
    here, there = MF.reference_run(case), SR.run(case)
    assert torch.equal(here.logits, there.logits)
    assert set(there.grads) == set(here.grads) and len(here.grads) > 4
    assert all(torch.equal(here.grads[n], there.grads[n]) for n in here.grads)  # the parent's thread count


def test_a_wrong_stack_fails_the_separate_reference(monkeypatch):
    assert "llama: logits beyond tolerance of the float64 adapted model" in _failed(
        Patching(True, monkeypatch, scale=2.0), "llama"
    )


def test_a_child_that_fails_is_named():
    case = MF.build_case(resolve_implementation("torch"), ARCHITECTURES["llama"], torch.float32, "cpu")
    case = dataclasses.replace(case, arch=dataclasses.replace(case.arch, name="no-such-family"))
    with pytest.raises(RuntimeError, match=r"no-such-family in a fresh process exited with 1: .*KeyError"):
        SR.run(case)
