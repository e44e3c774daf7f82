"""Training with expert adapters (issue 71), on the CPU with a tiny Qwen3-MoE: the model YAML of the convergence tier's
MoE case, a dense model refused for ``target_parameters`` at load time, the tiny tier trained with lora_core's and
PEFT's expert adapters from the same start (``Prepared.canonical``) to the same losses, every expert trained, and the
check of untrained experts failing on a stack whose optimizer never sees them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lora_core.targets import EXPERT_PARAMETERS
from lora_suite.engine.gradients import copy_adapters
from lora_suite.engine.prepare import prepare
from lora_suite.engine.trainer import train
from lora_suite.judges.expert_adapters import experts_left_untrained
from lora_suite.settings.config import SettingsError
from lora_suite.settings.loader import load_model_config
from lora_suite.tiers.convergence.test_moe_convergence import ATTENTION

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def moe_cfg(tiny_cfg):
    """The tiny tier on a 2-layer Qwen3-MoE (4 experts, 2 per token), its experts adapted."""
    arch = dataclasses.replace(
        tiny_cfg.model.architecture, family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    )
    return dataclasses.replace(
        tiny_cfg,
        model=dataclasses.replace(tiny_cfg.model, architecture=arch),
        lora=dataclasses.replace(tiny_cfg.lora, targets=ATTENTION, target_parameters=EXPERT_PARAMETERS),
        train=dataclasses.replace(tiny_cfg.train, steps=12, warmup_steps=2),
        criteria=dataclasses.replace(tiny_cfg.criteria, loss_window=3),
    )


def test_the_moe_model_yaml_is_smollm2_attention_with_experts():
    moe, smollm2 = load_model_config("qwen3-moe-smollm2-shape").architecture, load_model_config("smollm2-135m")
    same = ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings")
    assert all(getattr(moe, f) == getattr(smollm2.architecture, f) for f in same)
    assert (moe.family, moe.num_experts, moe.num_experts_per_tok) == ("qwen3_moe", 8, 2)


def test_expert_targets_on_a_dense_model_are_refused_at_load(tiny_cfg):
    with pytest.raises(
        SettingsError, match=r"lora.target_parameters.*model tiny-llama \(family llama\) has no experts"
    ):
        dataclasses.replace(tiny_cfg, lora=dataclasses.replace(tiny_cfg.lora, target_parameters=EXPERT_PARAMETERS))


def _trained(cfg, impl: str, init=None):
    p = prepare(cfg, "cpu", implementation=impl)
    start = {n: t.detach().clone() for n, t in p.canonical().items()}
    if init is not None:
        copy_adapters(p.canonical(), init)
        start = init
    result = train(p.model, p.batches, cfg.train, adapters=p.adapters)
    return p, start, result


def test_lora_core_and_peft_train_the_same_experts_to_the_same_losses(moe_cfg):
    pytest.importorskip("peft")
    ours, init, mine = _trained(moe_cfg, "torch")
    assert sorted(ours.experts) == [
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in sorted(EXPERT_PARAMETERS)
    ]
    final = {n: t.detach().clone() for n, t in ours.canonical().items()}
    judged, left = experts_left_untrained(init, final, ours.experts)
    assert judged == 2 * 2 * 2 * 4 and left == []  # layers x parameters x factors x experts
    theirs, _, peft_run = _trained(moe_cfg, "peft", init)
    assert sorted(theirs.experts) == sorted(ours.experts)
    torch.testing.assert_close(torch.tensor(peft_run.losses), torch.tensor(mine.losses), rtol=1e-4, atol=1e-5)


def test_untrained_experts_are_named():
    init = {"x.down_proj.lora_A": torch.zeros(3, 2, 4), "x.down_proj.lora_B": torch.zeros(3, 4, 2)}
    final = {n: t.clone() for n, t in init.items()}
    final["x.down_proj.lora_B"][1] += 1
    judged, left = experts_left_untrained(init, final, ["x.down_proj"])
    assert judged == 6 and "x.down_proj.lora_B expert 1" not in left and len(left) == 5


class FrozenExperts:
    """PEFT with its expert adapters left frozen after injection (the experts built, never trained)."""

    @staticmethod
    def make():
        from lora_suite.implementations.peft_impl import PeftImplementation

        class Frozen(PeftImplementation):
            def inject(self, model, spec):
                out = super().inject(model, spec)
                for ex in self.expert_adapters(model).values():
                    ex.a.requires_grad_(False)
                    ex.b.requires_grad_(False)
                return out

        return Frozen()


def test_a_stack_whose_experts_stay_frozen_has_every_expert_named(moe_cfg):
    pytest.importorskip("peft")
    p, init, _ = _trained(moe_cfg, FrozenExperts.make())
    final = {n: t.detach().clone() for n, t in p.canonical().items()}
    judged, left = experts_left_untrained(init, final, p.experts)
    assert judged == 32 and len(left) == judged
