"""The float64 reference of a stack whose model is not the one built (``lora_suite.judges.stack_reference``) on the
CPU: a process-wide patch of transformers' code (as Liger's) runs in the stack's model and not in the reference; with
bitsandbytes:
PEFT on bitsandbytes NF4 is judged on every architecture at fp32-level error against its own dequantised base (the
NF4 rounding not counted as LoRA error, and judged on its own); a loader that quantises a square weight transposed,
one that quantises with another block size's statistics, and a doubled LoRA scale on the 4-bit layers each fail the
check named for them."""

from __future__ import annotations

import pytest
import torch

from lora_suite.engine.architectures import ARCHITECTURES
from lora_suite.implementations import resolve_implementation
from lora_suite.implementations.peft_bnb_impl import PeftBnbImplementation, quantize_to_bnb
from lora_suite.implementations.peft_impl import PeftImplementation
from lora_suite.judges import model_function as MF

pytestmark = pytest.mark.usefixtures("one_thread")
F32 = torch.float32


def _bnb():
    pytest.importorskip("bitsandbytes")
    return resolve_implementation("peft-bnb")


def failed(impl, name: str = "llama") -> list[str]:
    return [v.name.split(" (of ")[0] for v in MF.judge(impl, ARCHITECTURES[name], F32, "cpu") if not v.passed]


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_peft_on_bitsandbytes_is_judged_on_every_family(name):
    impl = _bnb()
    arch = ARCHITECTURES[name]
    assert MF.not_applicable_reason(impl, arch) is None
    verdicts = MF.judge(impl, arch, F32, "cpu")
    assert any(v.name.startswith(f"{name}: base weights beyond NF4's rounding") for v in verdicts)
    assert [v.name for v in verdicts if not v.passed] == []


class QuantisesTransposed(PeftBnbImplementation):
    """Quantises Wᵀ where a weight is square (the q and o projections here), W elsewhere."""

    def quantize_base(self, model):
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.Linear) and m.weight.shape[0] == m.weight.shape[1]:
                    m.weight.copy_(m.weight.T.clone())
        return quantize_to_bnb(model)


class ScalesTwice(PeftBnbImplementation):
    def inject(self, model, spec):
        out = super().inject(model, spec)
        from peft.tuners.lora import LoraLayer

        for m in model.modules():
            if isinstance(m, LoraLayer):
                m.scaling["default"] *= 2
        return out


@pytest.mark.parametrize(
    ("plant", "check"),
    [
        (QuantisesTransposed, "llama: base weights beyond NF4's rounding of the built ones"),
        (ScalesTwice, "llama: logits beyond tolerance of the float64 adapted model"),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_each_planted_4bit_defect_fails_its_check(plant, check):
    _bnb()
    assert check in failed(plant())


def test_the_nf4_bound_holds_bitsandbytes_with_room_and_refuses_a_coarser_rounding():
    """On the weights bitsandbytes quantised, the largest error is below the bound; scaled by 3 (the rounding of a
    format with a third of NF4's levels) it is not."""
    from lora_suite.judges import stack_reference as SR

    impl = _bnb()
    case = MF.build_case(impl, ARCHITECTURES["llama"], F32, "cpu")
    assert case.built is not None
    assert SR.nf4_verdict("llama", case.built, case.reference, F32).passed
    with torch.no_grad():
        for name, w in case.built.items():
            if name.endswith("proj.weight"):
                q = case.reference.get_parameter(name)
                q.copy_(w.double() + 3 * (q - w.double()))
    assert not SR.nf4_verdict("llama", case.built, case.reference, F32).passed


def test_the_options_and_the_combination_on_unquantised_models_say_the_base_is_4_bit():
    """Their cases build unquantised fp32 models: on a stack whose base is always 4-bit they are not applicable with
    that reason, not run over a base the stack refuses (an H100 quick run of peft-bnb crashed there once)."""
    from lora_suite.judges import adapter_options as AO
    from lora_suite.judges import combined_adapters as CA
    from lora_suite.judges.option_cases import OPTIONS

    impl = _bnb()
    assert all("bf16_base" in (AO.not_applicable_reason(impl, name) or "") for name in OPTIONS)
    assert "bf16_base" in (CA.not_applicable_reason(impl) or "")


class PatchesRopeForTheProcess(PeftImplementation):
    """PEFT, plus a process-wide patch of transformers' Llama RoPE that rotates nothing (as Liger patches
    ``modeling_llama.apply_rotary_pos_emb``, here wrong): the float64 reference built in the same process must not
    run it."""

    name = expected_path = "peft"

    def inject(self, model, spec):
        from transformers.models.llama import modeling_llama

        modeling_llama.apply_rotary_pos_emb = lambda q, k, *args, **kwargs: (q, k)
        return super().inject(model, spec)


def test_a_process_wide_patch_of_transformers_is_judged_not_shared_by_the_reference():
    from transformers.models.llama import modeling_llama

    own = modeling_llama.apply_rotary_pos_emb
    try:
        assert "llama: logits beyond tolerance of the float64 adapted model" in failed(PatchesRopeForTheProcess())
    finally:
        modeling_llama.apply_rotary_pos_emb = own
