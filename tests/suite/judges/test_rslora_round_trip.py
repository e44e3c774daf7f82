"""The quick tier's rsLoRA round trip (``tiers/quick/test_adapter_round_trip.py``) on the CPU: a loader that remembers
the use_rslora of its first load (a value computed once and reused: ``lora-suite mutate``'s CacheFirstValue left
exactly this in PEFT's glue alive on an H100, issue 55) passes every round trip of a model without rsLoRA and fails
the one with it; PEFT's own glue passes both."""

from __future__ import annotations

import dataclasses

import pytest

from lora_suite.engine.prepare import prepare
from lora_suite.judges import round_trip as RT

pytest.importorskip("peft")
from lora_suite.implementations.peft_impl import PeftImplementation  # noqa: E402


class RemembersFirstSetting(PeftImplementation):
    name = expected_path = "peft"

    def load_adapter(self, model, path):
        config = model._lora_suite_peft_config
        remembered = self.__dict__.setdefault("_first_rslora", bool(config.use_rslora))
        model._lora_suite_peft_config = dataclasses.replace(config, use_rslora=remembered)
        try:
            super().load_adapter(model, path)
        finally:
            model._lora_suite_peft_config = config


def _failed(impl, cfg, tmp_path, rslora: bool) -> list[str]:
    lora = dataclasses.replace(cfg.lora, use_rslora=rslora, targets=("q_proj", "v_proj"))  # as the quick tier's
    cfg = dataclasses.replace(cfg, dtype="float32", lora=lora)
    trained = prepare(cfg, "cpu", implementation=impl)
    RT.train_a_few(trained, 3, 1e-2)
    build = lambda: prepare(cfg, "cpu", implementation=impl)  # noqa: E731
    verdicts = RT.round_trip(trained, build, tmp_path / f"rslora-{rslora}", tampered=("use_rslora",))
    return [v.name for v in verdicts if not v.passed]


@pytest.mark.parametrize("impl,caught", [(PeftImplementation(), False), (RemembersFirstSetting(), True)])
def test_a_loader_that_remembers_its_first_setting_fails_only_the_rslora_round_trip(impl, caught, tiny_cfg, tmp_path):
    assert _failed(impl, tiny_cfg, tmp_path, rslora=False) == []
    failed = _failed(impl, tiny_cfg, tmp_path, rslora=True)
    assert bool(failed) == caught, failed
