"""quick tier: SmolLM2-135M architecture, 10 LoRA steps with the implementation under test: is the stack alive?"""

from __future__ import annotations

import math

import pytest
import torch

from lora_suite.engine.optimizer import make_optimizer
from lora_suite.engine.prepare import targets_left_out
from lora_suite.implementations.contract import LoRAImplementation

pytestmark = [pytest.mark.gpu, pytest.mark.quick, pytest.mark.model_code]


def op_calls(impl: LoRAImplementation) -> int | None:
    """LoRA op calls counted by the implementation, or None (recorded as not applicable by the caller)."""
    return None if impl.reason_not_applicable("op_call_count") else impl.op_calls()


def test_quick_smoke(tier):
    cfg = tier.config("quick")
    check = tier.check
    check("CUDA device visible", torch.cuda.device_count(), ">=", 1)
    prepared = tier.prepare(cfg)
    model = prepared.model
    adapters = prepared.adapters
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    initial = {n: p.detach().clone() for n, p in adapters.items()}
    calls_before = op_calls(tier.impl)

    optimizer = make_optimizer(model, cfg.train, adapters)
    result = tier.train("quick", prepared, cfg, optimizer=optimizer)
    torch.cuda.synchronize()  # any asynchronous CUDA error surfaces here, and stops the session

    tier.check_served(prepared)
    name = "LoRA op calls served by the implementation under test"
    calls_after = op_calls(tier.impl)
    if calls_before is None or calls_after is None:
        check.not_applicable(name, tier.impl.reason_not_applicable("op_call_count"))
    else:
        check(name, calls_after - calls_before, ">=", cfg.train.steps * len(prepared.replaced))
    check("all losses finite", all(math.isfinite(x) for x in result.losses), "==", True)
    no_grad = [n for n, p in adapters.items() if p.grad is None]
    non_finite = [n for n, p in adapters.items() if p.grad is not None and not torch.isfinite(p.grad).all()]
    zero = [n for n, p in adapters.items() if p.grad is not None and not p.grad.abs().sum() > 0]
    left_out = targets_left_out(model, cfg.lora.targets, prepared.replaced)
    check(
        "target projections left without adapters",
        len(left_out),
        "==",
        0,
        source="configs/quick.yaml lora.targets: every matching nn.Linear gets an adapter",
        detail=", ".join(left_out[:4]),
    )
    check("adapters without a gradient", len(no_grad), "==", 0, detail=str(no_grad[:3]))
    check("adapter gradients with NaN/Inf", len(non_finite), "==", 0, detail=str(non_finite[:3]))
    check("adapter gradients all zero", len(zero), "==", 0, detail=str(zero[:3]))
    changed_base = [n for n, p in model.named_parameters() if n in base and not torch.equal(p, base[n])]
    check("base parameters changed (must be bit-identical)", len(changed_base), "==", 0, detail=str(changed_base[:3]))
    unchanged = [n for n, p in adapters.items() if torch.equal(p, initial[n])]
    check("adapters unchanged by training", len(unchanged), "==", 0, detail=str(unchanged[:3]))
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    check("optimizer params == adapter params", in_optimizer == {id(p) for p in adapters.values()}, "==", True)
    check(
        "model build time",
        round(prepared.built.build_seconds, 2),
        "<=",
        cfg.criteria.build_seconds_max,
        unit=" s",
        source="configs/quick.yaml build_seconds_max",
    )
