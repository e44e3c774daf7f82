"""One implementation object, two models: what a stack keeps must live on each model, never on the implementation.

A training script builds an implementation once and adapts several models with it (a run and its evaluation copy, a
sweep over ranks, the fresh model a checkpoint is loaded into). A stack that remembers the first model's settings, its
targets or its layers on the implementation object (a value computed on the first call and reused) passes every check
of one model and breaks the second. Judged on two probe blocks adapted by the same object with different settings:

- model A: the attention's four projections, r = 4, alpha = 7.3; model B: all seven, r = 8, alpha = 12;
- only B runs a forward: ``served_by(B)``, asked first, names the path under test, and ``served_by(A)`` then must not
  claim it served A (none of A's layers ran);
- each saved folder's ``adapter_config.json`` names its own model's r, lora_alpha and target projections.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lora_suite.engine import probes as P
from lora_suite.implementations import AdapterSpec, LoRAImplementation
from lora_suite.judges.layer_checks import none_of
from lora_suite.measure.criteria import Verdict

SOURCE = "a stack's state lives on each model (PEFT keeps LoraConfig per model); two_models.py"


def specs(adapter_dtype: torch.dtype | None, quantize: str | None) -> tuple[AdapterSpec, AdapterSpec]:
    """Model A's and model B's settings (module docstring)."""
    a = AdapterSpec(P.ATTN, 4, 7.3, False, adapter_dtype, quantize)
    b = AdapterSpec(P.PROBE_TARGETS, 8, 12.0, False, adapter_dtype, quantize)
    return a, b


def _config_mismatch(folder: Path, spec: AdapterSpec, label: str) -> list[str]:
    config = json.loads((folder / "adapter_config.json").read_text())
    targets = config.get("target_modules")
    leaves = sorted({str(t).rsplit(".", 1)[-1] for t in targets}) if isinstance(targets, (list, tuple)) else targets
    want = {"r": spec.r, "lora_alpha": spec.alpha, "target_modules": sorted(spec.targets)}
    got = {"r": config.get("r"), "lora_alpha": config.get("lora_alpha"), "target_modules": leaves}
    return [f"{label}'s folder has {k}={got[k]!r}, the model {v!r}" for k, v in want.items() if got[k] != v]


def two_models(
    impl: LoRAImplementation, shape: P.BlockShape, dtype: torch.dtype, device, folder: Path, *, adapter_dtype=None
) -> Verdict:
    """The module docstring's checks; ``folder`` receives the two saved adapters."""
    quantize = "nf4" if impl.reason_not_applicable("bf16_base") else None
    spec_a, spec_b = specs(adapter_dtype, quantize)
    a = P.build_probe(impl, shape, spec_a, dtype, device, seed=1)
    b = P.build_probe(impl, shape, spec_b, dtype, device, seed=2)
    P.run_probe(b, P.random_inputs(shape, (2, 5), dtype, device, seed=3))
    bad = []
    if (served := impl.served_by(b.block)) != impl.expected_path:  # asked first: an answer kept would be B's
        bad.append(f"served_by(B) = {served!r} after B's forward, not {impl.expected_path!r}")
    if (served := impl.served_by(a.block)) == impl.expected_path:
        bad.append(f"served_by(A) = {served!r} though no layer of A ran (B's forward counted for A)")
    for label, probe, spec in (("A", a, spec_a), ("B", b, spec_b)):
        saved = Path(impl.save_adapter(probe.block, folder / label))
        bad += _config_mismatch(saved, spec, label)
    return none_of(
        "two models adapted by one implementation: state of one seen in the other (served_by, saved r, lora_alpha, "
        "target_modules)",
        bad,
        SOURCE,
        shown=4,
    )
