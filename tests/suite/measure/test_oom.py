"""A CUDA out-of-memory as a verdict (issue 56, item 7; ``lora_suite.measure.oom``), on the CPU: where it struck in the
trainer, what held the memory, and what would fit; a session that keeps going after it, the frames released."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lora_suite.engine.prepare import prepare
from lora_suite.engine.trainer import train
from lora_suite.measure import oom as O
from lora_suite.measure.memory import estimate_tier

pytest_plugins = ["pytester"]


def _oom_during(tiny_cfg, hook: str, at_step: int):
    """The traceback of an out-of-memory raised by a hook of the first decoder layer, in ``hook`` (forward or
    backward) of optimizer step ``at_step``."""
    cfg = dataclasses.replace(
        tiny_cfg,
        train=dataclasses.replace(tiny_cfg.train, steps=6, warmup_steps=0, grad_accum=1),
        criteria=dataclasses.replace(tiny_cfg.criteria, loss_drop_min=None),  # no loss bar: its windows need 10 steps
    )
    p = prepare(cfg, "cpu")
    calls = {"n": 0}

    def boom(*_):
        calls["n"] += 1
        if calls["n"] > at_step:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    layer = p.model.model.layers[0]
    layer.register_forward_pre_hook(boom) if hook == "forward" else layer.register_full_backward_hook(boom)
    with pytest.raises(torch.OutOfMemoryError) as excinfo:
        train(p.model, p.batches, cfg.train, adapters=p.adapters)
    return excinfo, p


@pytest.mark.parametrize("hook", ["forward", "backward"])
def test_the_site_names_the_step_and_the_phase(tiny_cfg, hook):
    excinfo, _ = _oom_during(tiny_cfg, hook, at_step=2)
    assert O.oom_site(excinfo.tb) == (2, hook)


def test_outside_the_loop_is_said_so():
    try:
        raise torch.OutOfMemoryError("CUDA out of memory")
    except torch.OutOfMemoryError as exc:
        assert O.oom_site(exc.__traceback__) == (None, O.OUTSIDE)


def test_the_largest_live_tensors_are_named_by_their_owners(tiny_cfg):
    excinfo, p = _oom_during(tiny_cfg, "backward", at_step=1)
    rows = O.largest_live_tensors(n=50, device_type="cpu")
    owners = [owner for _, _, owner in rows]
    embed = next(n for n, _ in p.model.named_parameters() if "embed_tokens" in n)
    assert f"{type(p.model).__name__}.{embed}" in owners, owners[:10]
    assert rows == sorted(rows, key=lambda r: -r[0])


def test_what_would_fit_estimates_each_change_against_the_card(tiny_cfg):
    cfg = tiny_cfg
    base = estimate_tier(cfg).device_need
    lines = O.what_would_fit(cfg, base - 1)  # the card one byte short of what the tier needs
    assert len(lines) == 3 and lines[0].startswith(f"micro-batch {max(1, cfg.data.batch_size // 2)}")
    assert any(line.endswith(", fits") for line in lines), lines
    assert all("does not fit" in line for line in O.what_would_fit(cfg, 1)), "a card of one byte fits nothing"


def test_an_out_of_memory_is_a_failed_check_saying_why_and_the_session_goes_on(pytester, monkeypatch):
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    monkeypatch.setenv("PYTHONPATH", str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pytester.makeconftest((root / "conftest.py").read_text())
    pytester.makepyfile(
        test_sample="""
        import gc, weakref, torch
        HELD = {}

        class Model:
            pass

        def test_out_of_memory():
            model = Model()
            HELD["ref"] = weakref.ref(model)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        def test_after_it():
            gc.collect()
            assert HELD["ref"]() is None, "the failed test's frames still hold its objects"
    """
    )
    result = pytester.runpytest_subprocess("--report-dir", "out", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    import json

    report = json.loads((pytester.path / "out" / "report.json").read_text())
    (check,) = report["checks"]
    assert check["name"] == f"CUDA out of memory at {O.OUTSIDE}" and not check["passed"], check
    assert check["detail"].startswith("CUDA out of memory. Tried to allocate 2.00 GiB"), check["detail"]
    assert report["verdict"]["result"] == "FAIL"


def test_what_would_fit_offers_only_changes_that_change_something(tiny_cfg):
    """A micro-batch of 1 cannot halve and checkpointing already on cannot be turned on (the memory tier on an H100
    under --vram-limit 1 was offered 'micro-batch 1' at a micro-batch of 1)."""
    import dataclasses

    cfg = dataclasses.replace(
        tiny_cfg,
        data=dataclasses.replace(tiny_cfg.data, batch_size=1),
        train=dataclasses.replace(tiny_cfg.train, gradient_checkpointing=True),
    )
    (line,) = O.what_would_fit(cfg, 1)
    assert line.startswith(f"sequence length {cfg.data.seq_len // 2}:"), line
