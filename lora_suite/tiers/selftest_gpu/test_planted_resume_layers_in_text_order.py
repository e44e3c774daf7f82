"""selftest-gpu: the convergence tier's resumed-run check fails on a resume that gives AdamW's moments to the wrong
adapters, and passes on a complete one.

The planted implementation (``lora_suite.scenarios.resume_layers_in_text_order``) is cupy, except that a model which
has loaded adapters lists them with its decoder layers in text order (0, 1, 10, ..., 2, 20, ...): the resumed
optimizer's state, keyed by position, lands on other layers' adapters of the same shapes. One uninterrupted cupy run
of the convergence tier's config writes the checkpoint at ``criteria.resume_at_step``; the planted implementation and
cupy itself (the control) each resume it, and each is judged as the tier judges its own
(``resume_match`` of ``lora_suite/tiers/convergence/test_convergence_tier.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_suite.harness.modules import load_test_module
from lora_suite.scenarios.resume_layers_in_text_order import cupy_text_order

pytestmark = [pytest.mark.gpu, pytest.mark.selftest_gpu]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.needs_feature("lora_core_ops")
def test_a_resume_with_moments_on_other_layers_leaves_the_band_and_a_complete_one_stays(tier, tmp_path):
    conv = load_test_module(ROOT / "tiers/convergence/test_convergence_tier.py", "convergence_tier_resume_plant")
    cfg = tier.config("convergence")
    at = cfg.criteria.resume_at_step
    first = tier.prepare(cfg, implementation="cupy")
    init = {n: p.detach().clone() for n, p in first.adapters.items()}
    del first
    kept: dict = {}
    directory = tmp_path / "resume"
    ours = conv._run(tier, cfg, "cupy", init, checkpoint=(at, directory), kept=kept)
    source = "convergence tier's resumed-run check (configs/convergence.yaml resume_at_step)"
    planted = conv.resume_match(tier, cfg, cupy_text_order(), ours.losses, kept, directory, "planted: ")
    tier.check(
        f"planted moments on other layers after a resume at step {at}: steps beyond the band (first: {planted[:5]})",
        len(planted),
        ">",
        0,
        source=source,
    )
    clean = conv.resume_match(tier, cfg, "cupy", ours.losses, kept, directory, "clean: ")
    tier.check(f"clean cupy resume: steps beyond the band (first: {clean[:5]})", len(clean), "==", 0, source=source)
