"""The convergence tier's loss-match criterion can fail: a wrong gradient leaves the band, a correct
re-association of the same math stays inside it (tiny Llama, CPU, the criterion of lora_suite.measure.criteria)."""

from __future__ import annotations

import dataclasses

import pytest
import torch.nn.functional as F

from lora_core.inject import adapter_parameters
from lora_core.ops import lora_linear as op
from lora_suite.engine.gradients import copy_adapters, perturb_lora_a
from lora_suite.engine.prepare import prepare
from lora_suite.engine.trainer import train
from lora_suite.measure.criteria import loss_match, widest_control

# the convergence tier's values (configs/convergence.yaml)
FACTOR, FLOOR, PERTURB, CONTROLS = 4, 2.0**-10, 2.0**-8, 3


def _run(cfg, init, perturb=0.0, seed=99):
    p = prepare(cfg, "cpu")
    adapters = adapter_parameters(p.model)
    copy_adapters(adapters, init)
    if perturb:
        perturb_lora_a(adapters, perturb, seed=seed)
    return train(p.model, p.batches, cfg.train).losses


def _merged(x, weight, lora_a, lora_b, scale):  # the same function, rounded differently: x (s·B A)ᵀ
    return F.linear(x, weight) + F.linear(x, scale * (lora_b.to(x.dtype) @ lora_a.to(x.dtype)))


def _stale_a(x, weight, lora_a, lora_b, scale):  # a classic bug: no gradient reaches A
    return F.linear(x, weight) + scale * F.linear(F.linear(x, lora_a.detach().to(x.dtype)), lora_b.to(x.dtype))


@pytest.fixture
def setup(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, train=dataclasses.replace(tiny_cfg.train, steps=30))
    init = {n: p.detach().clone() for n, p in adapter_parameters(prepare(cfg, "cpu").model).items()}
    ref = _run(cfg, init)
    control = widest_control([_run(cfg, init, PERTURB, seed=99 + i) for i in range(CONTROLS)], ref)
    return cfg, init, ref, control


@pytest.mark.parametrize("candidate,caught", [(_merged, False), (_stale_a, True)], ids=["reassociated", "stale-dA"])
def test_loss_match_separates_rounding_from_bugs(setup, monkeypatch, candidate, caught):
    cfg, init, ref, control = setup
    monkeypatch.setattr(op, "lora_linear_torch", candidate)
    ours = _run(cfg, init)
    _, beyond = loss_match(ours, ref, control, FACTOR, FLOOR)
    assert bool(beyond) == caught, f"steps beyond the band: {beyond}"


def test_the_widest_control_is_the_running_max_over_every_control():
    ref = [10.0, 10.0, 10.0, 10.0]
    a, b = [10.0, 10.2, 9.9, 10.0], [10.0, 9.7, 10.05, float("nan")]
    assert widest_control([a, b], ref)[:3] == [10.0, 9.7, 9.9]
    rows, _ = loss_match(ref, ref, widest_control([a, b], ref), FACTOR, FLOOR)
    assert [round(r[4], 6) for r in rows[:3]] == [0.0, 0.03, 0.03]
    widest = widest_control([a, b], ref)[3]
    assert widest != widest  # a NaN control is the farthest; loss_match's running max keeps the finite envelope
    with pytest.raises(ValueError, match=r"control runs of \[4, 3\] steps, reference of 4"):
        widest_control([a, b[:3]], ref)
    with pytest.raises(ValueError, match="got none"):
        widest_control([], ref)
