"""convergence tier on a mixture-of-experts model: the runs and checks of ``test_convergence_tier.converge`` on a
Qwen3-MoE at SmolLM2's attention widths (``configs/models/qwen3-moe-smollm2-shape.yaml``, random-initialised), its
experts' 3-D parameters adapted too (``lora.target_parameters``: gate_up_proj and down_proj), eager steps (the routing
decides each expert's work on the host: nothing to capture), the attention's four linears adapted by name. Every run starts from the same adapters, each stack's
expert factors written through its own layout (``Prepared.canonical``); the torch reference (lora_core's LoRAExperts
on torch ops) and PEFT (``target_parameters``) train the same experts. One more check: no expert's factors left at
their start (``expert_adapters.experts_left_untrained``). Check and table names start with ``qwen3-moe: ``.
"""

from __future__ import annotations

import dataclasses

import pytest

from lora_core.targets import EXPERT_PARAMETERS
from lora_suite.judges.expert_adapters import experts_left_untrained
from lora_suite.settings.loader import load_model_config
from lora_suite.tiers.convergence.test_convergence_tier import converge

pytestmark = [pytest.mark.gpu, pytest.mark.convergence]
MOE_SHAPE = "qwen3-moe-smollm2-shape"  # lora_suite/configs/models/
LABEL = "qwen3-moe: "


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def moe_config(cfg):
    """The convergence tier's settings on the MoE model: the attention's linears and the experts adapted (not
    "all-linear", which PEFT reads as the routers' weights too, lora_core as nn.Linear only), steps eager."""
    return dataclasses.replace(
        cfg,
        model=load_model_config(MOE_SHAPE),
        weights="random",
        lora=dataclasses.replace(cfg.lora, targets=ATTENTION, target_parameters=EXPERT_PARAMETERS),
        train=dataclasses.replace(cfg.train, cuda_graph=False),
    )


def test_convergence_on_a_moe_model_with_its_experts_adapted(tier, tmp_path):
    why = tier.impl.reason_not_applicable("moe_experts")
    if why:
        tier.check.not_applicable(f"{LABEL}every check of this model (its experts adapted)", why)
        return
    cfg = moe_config(tier.config("convergence"))
    init, final = converge(tier, cfg, LABEL, tmp_path)
    names = sorted({n.rsplit(".", 1)[0] for n, t in init.items() if t.dim() == 3})  # (E, ...): the expert factors
    judged, left = experts_left_untrained(init, final, names)
    tier.check(
        f"{LABEL}expert factors left at their start after training (of {judged}; first: {left[:3]})",
        len(left),
        "==",
        0,
        source="every expert is routed to over the run and trains (expert_adapters.experts_left_untrained)",
    )
