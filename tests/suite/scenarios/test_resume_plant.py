"""The planted resume defect (``lora_suite.scenarios.resume_layers_in_text_order``) on the CPU: what it reorders, and
that it changes nothing before a load (the uninterrupted run is the implementation's own)."""

from __future__ import annotations

import dataclasses

from lora_suite.engine.prepare import prepare
from lora_suite.scenarios.resume_layers_in_text_order import TextOrderAfterLoad, text_order


def test_text_order_sorts_layers_as_text_and_keeps_each_layers_own_order():
    names = [f"model.layers.{i}.self_attn.{p}.lora_{m}" for i in (0, 2, 10) for p in ("q_proj", "v_proj") for m in "AB"]
    got = text_order(["lm_head.lora_A", *names])
    assert got[0] == "lm_head.lora_A"
    assert [n.split(".")[2] for n in got[1:]] == ["0"] * 4 + ["10"] * 4 + ["2"] * 4
    assert got[1:5] == names[:4]
    assert text_order(names[:8]) == names[:8]  # layers 0 and 2 only: single digits sort alike


def test_the_plant_lists_adapters_as_lora_core_does_until_a_load_and_in_text_order_after(tiny_cfg, tmp_path):
    arch = dataclasses.replace(tiny_cfg.model.architecture, num_hidden_layers=12)
    cfg = dataclasses.replace(tiny_cfg, model=dataclasses.replace(tiny_cfg.model, architecture=arch))
    plant = TextOrderAfterLoad("torch")
    p = prepare(cfg, "cpu", implementation=plant)
    before = list(plant.adapter_parameters(p.model))
    assert before == list(p.adapters)
    plant.save_adapter(p.model, tmp_path)
    plant.load_adapter(p.model, tmp_path)
    after = list(plant.adapter_parameters(p.model))
    assert after == text_order(before) != before
    assert [tuple(plant.adapter_parameters(p.model)[n].shape) for n in after] == [
        tuple(p.adapters[n].shape) for n in before
    ]  # every position keeps its shape: the misplaced optimizer state loads without an error
