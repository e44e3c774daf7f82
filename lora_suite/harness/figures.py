"""A tier's headline figures: each declared in its YAML (``suite.figures``: name, unit, clock, which way is better)
and recorded into the run report as a ``Figure`` with its spread; ``compare`` gates them night to night and
``ledger record`` keeps them. A name the tier does not declare is an error: a figure the gate does not know would
never be gated."""

from __future__ import annotations

from lora_suite.settings.config import CONFIG_DIR
from lora_suite.settings.loader import load_tier_config


def record_figure(
    report, test: str, tier: str, name: str, value: float, *, p20=None, p80=None, samples: int = 1, missing_ok=False
):
    """``RunReport.figure`` of ``name`` as configs/<tier>.yaml declares it; p20 and p80 where it is a median.
    ``missing_ok``: a tier that does not declare it records nothing (a helper several tiers share)."""
    from lora_suite.harness.report import Figure

    entry = load_tier_config(CONFIG_DIR / f"{tier}.yaml").suite
    spec = next((f for f in (entry.figures if entry else ()) if f.name == name), None)
    if spec is None and missing_ok:
        return None
    if spec is None:
        known = [f.name for f in entry.figures] if entry else []
        raise ValueError(f"configs/{tier}.yaml suite.figures declares no {name!r} (it declares {known})")
    p20, p80 = (None if v is None else float(v) for v in (p20, p80))
    return report.figure(Figure(test, name, float(value), spec.unit, spec.clock, spec.better, p20, p80, samples))
