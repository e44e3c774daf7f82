"""The verdicts of whole-model gradient runs (``lora_suite.engine.gradients.whole_model_checks``), as every tier that
runs them judges them (quick at its batch, longcontext at 8192 tokens): per run, a table of every adapter's
relative error against the fp32 reference with the 16-bit reference's own error and the tolerance, then two checks,

    adapters with err > grad_match_factor · max(err_16bit_ref, median err_16bit_ref)  == 0
    |loss − fp32 loss| / fp32 loss  ≤  grad_match_factor · max(16-bit reference's gap, grad_loss_floor)
"""

from __future__ import annotations

from lora_suite.engine import gradients as G
from lora_suite.harness.report import Series


def judge_gradients(tier, results, crit, config: str) -> None:
    """Add the table and the two checks of each of ``results`` (``WholeModelResult``) to ``tier``'s report, the
    thresholds from ``crit`` (the ``Criteria`` of ``configs/<config>.yaml``)."""
    source = (
        f"err <= grad_match_factor * max(err_16bit_ref, median): configs/{config}.yaml, lora_suite/engine/gradients.py"
    )
    for res in results:
        tier.report.add_series(
            Series(
                tier.nodeid,
                f"step-0 adapter gradients vs fp32: {res.label}",
                ("adapter", "rel err", "16-bit ref rel err", "tolerance", "verdict"),
                tuple((r.name, r.err, r.err_base, r.tol, "ok" if r.ok else "FAIL") for r in res.rows),
            )
        )
        tier.check(
            f"{res.label}: adapters beyond tolerance (of {len(res.rows)})",
            res.n_bad,
            "==",
            0,
            source=source,
            detail=G.describe_failures(res.rows),
        )
        tier.check(
            f"{res.label}: |loss - fp32 loss| / fp32 loss",
            res.loss_gap,
            "<=",
            res.loss_tol(crit.grad_match_factor, crit.grad_loss_floor),
            source=f"grad_match_factor * max(16-bit ref gap, grad_loss_floor): configs/{config}.yaml",
        )


def against_reference(prepared, reference, batch, label: str, crit) -> list:
    """``whole_model_checks`` of ``prepared`` (the model under test) on ``batch`` against ``reference`` (the same base
    and adapter values on the torch reference backend), with ``crit``'s accumulation check and factor."""
    return G.whole_model_checks(
        prepared.model,
        batch,
        label=label,
        adapters=prepared.adapters,
        reference=reference.model,
        reference_adapters=reference.adapters,
        k=crit.grad_accum_k,
        factor=crit.grad_match_factor,
    )
