"""MoE expert adapters (``lora_suite.judges.expert_adapters`` and the experts in ``model_function``) on the CPU:
PEFT's ``target_parameters`` passes every check on Qwen3-MoE; stacks without expert adapters say why; each planted
defect of the class fails the check named for it: a doubled expert scale, a merge that reads B expert-major (the
layout PEFT does not use), one that folds a square expert slice transposed, a gradient written to every expert, a
load that skips the expert tensors, and a spec whose expert rank the stack ignores."""

from __future__ import annotations

import pytest
import torch

from lora_suite.engine.architectures import ARCHITECTURES
from lora_suite.implementations import resolve_implementation
from lora_suite.implementations.peft_impl import PeftImplementation
from lora_suite.judges import expert_adapters as EA
from lora_suite.judges import model_function as MF

pytestmark = pytest.mark.usefixtures("one_thread")
MOE = ARCHITECTURES["qwen3_moe"]
LOGITS = "qwen3_moe: logits beyond tolerance of the float64 adapted model"
MERGED = "qwen3_moe: merged experts, logits beyond tolerance of the float64 adapted model"
ROUTED = "qwen3_moe: expert adapters with a gradient where no token was routed, or none where one was"
LOADED = "qwen3_moe: expert adapters saved and loaded into a fresh model, factors or logits not the saved ones"


def failed(impl) -> list[str]:
    verdicts = MF.judge(impl, MOE, torch.float32, "cpu") + EA.judge(impl, MOE, torch.float32, "cpu")[0]
    return [v.name.split(" (of ")[0] for v in verdicts if not v.passed]


def _wrappers(model):
    from peft.tuners.lora.layer import ParamWrapper

    return [m for m in model.modules() if isinstance(m, ParamWrapper)]


def test_peft_adapts_every_expert_and_passes():
    impl = resolve_implementation("peft")
    assert MF.expert_reason(impl, MOE) is None
    case = MF.build_case(impl, MOE, torch.float32, "cpu")
    assert sorted(case.experts) == ["model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj"]
    assert failed(impl) == []


def test_lora_core_adapts_every_expert_and_passes():
    impl = resolve_implementation("torch")  # lora_core.LoRAExperts; the cupy backend runs the same code on the GPU
    assert MF.expert_reason(impl, MOE) is None
    case = MF.build_case(impl, MOE, torch.float32, "cpu")
    assert sorted(case.experts) == ["model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj"]
    assert failed(impl) == []


def test_stacks_without_expert_adapters_say_why():
    pytest.importorskip("loralib")
    assert "3-D expert parameters" in MF.expert_reason(resolve_implementation("loralib"), MOE)


class ScaleTwice(PeftImplementation):
    name = expected_path = "peft"

    def inject(self, model, spec):
        out = super().inject(model, spec)
        for m in _wrappers(model):
            m.scaling["default"] *= 2
        return out


def _fold(impl, model, wrong) -> None:
    """After PEFT's merge, each expert slice's W += wrong(s·Bₑ·Aₑ, A, B, E) − s·Bₑ·Aₑ."""
    with torch.no_grad():
        for m in _wrappers(model):
            e, s = int(m.num_experts), m.scaling["default"]
            a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
            right = s * b.reshape(b.shape[0], -1, e).permute(2, 0, 1) @ a.reshape(e, -1, a.shape[1])
            getattr(m.get_base_layer(), m.parameter_name).add_(wrong(right, a, b, e, s) - right)


class MergeBExpertMajor(PeftImplementation):
    """Merges with B read as (out, E, r): expert e's columns e·r..(e+1)·r (unsloth-zoo#1269's misreading)."""

    name = expected_path = "peft"

    def merge_adapters(self, model):
        super().merge_adapters(model)
        _fold(
            self,
            model,
            lambda right, a, b, e, s: s * b.reshape(b.shape[0], e, -1).permute(1, 0, 2) @ a.reshape(e, -1, a.shape[1]),
        )


class MergeSquareTransposed(PeftImplementation):
    """Folds s·(Bₑ·Aₑ)ᵀ where an expert slice is square (gate_up_proj here: 64 × 64), the right one elsewhere."""

    name = expected_path = "peft"

    def merge_adapters(self, model):
        super().merge_adapters(model)
        _fold(self, model, lambda right, a, b, e, s: right.mT if right.shape[-1] == right.shape[-2] else right)


class GradToEveryExpert(PeftImplementation):
    """Every expert's A gets a gradient term, routed to or not (a dense regulariser folded into the gradient)."""

    name = expected_path = "peft"

    def inject(self, model, spec):
        out = super().inject(model, spec)
        for m in _wrappers(model):
            m.lora_A["default"].weight.register_hook(lambda g: g + 1e-3)
        return out


class LoadSkipsExperts(PeftImplementation):
    """Loads the folder's tensors of linears and leaves the expert ones out (a loader that knows no ParamWrapper)."""

    name = expected_path = "peft"

    def load_adapter(self, model, path):
        import shutil
        import tempfile
        from pathlib import Path

        from safetensors.torch import load_file, save_file

        from lora_core.adapters import WEIGHTS_FILE

        kept = Path(tempfile.mkdtemp())
        shutil.copytree(path, kept, dirs_exist_ok=True)
        tensors = load_file(str(Path(path) / WEIGHTS_FILE))
        save_file({k: t for k, t in tensors.items() if ".experts." not in k}, str(kept / WEIGHTS_FILE))
        from lora_suite.implementations import load_peft_tensors

        load_peft_tensors(self.name, {**self.adapter_parameters(model), **self.option_parameters(model)}, kept, None)


@pytest.mark.parametrize(
    ("plant", "check"),
    [
        (ScaleTwice, LOGITS),
        (MergeBExpertMajor, MERGED),
        (MergeSquareTransposed, MERGED),
        (GradToEveryExpert, ROUTED),
        (LoadSkipsExperts, LOADED),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_each_planted_expert_defect_fails_its_check(plant, check):
    pytest.importorskip("peft")
    assert check in failed(plant())
