"""``--oom-retry``: a tier test that runs out of CUDA memory is run again from its start with half the micro-batch
and twice the gradient accumulation, so the effective batch B·k (micro-batch B, k micro-batches per optimizer step)
is kept: B·k = (B/2)·(2k). It halves again on a second out-of-memory, down to a micro-batch of 1; then the
out-of-memory stands as the verdict (``lora_suite.harness.oom_verdict``).

What the retried run judged is not what was asked for: each halving is a note naming where the memory ran out, and
a check (``RETRIED_CHECK``: the micro-batch used, below the configured one) whose presence makes the run's verdict
PASS (RETRIED), never PASS (``lora_suite.harness.verdict``). A failed attempt leaves nothing else: its checks,
notes, series and figures are taken back out of the run report before the test starts again (``RunReport.mark``),
its frames cleared and torch's cache emptied, so the second attempt starts on a released GPU. An odd micro-batch
halves to ⌊B/2⌋, and the note says the effective batch changed. The gradient-accumulation check's k micro-batches
(``criteria.grad_accum_k``) must divide the micro-batch (the settings' rule): where the halved one no longer has k as
a divisor, k becomes gcd(k, B/2), or no check where that is 1, and the note says so."""

from __future__ import annotations

import dataclasses
import functools
import math

from lora_suite.measure.card import RETRIED_CHECK


def retried_config(cfg, halvings: int):
    """``cfg`` (a TierConfig) with its micro-batch halved ``halvings`` times and its accumulation doubled as often."""
    if not halvings:
        return cfg
    batch = max(1, cfg.data.batch_size >> halvings)
    k = cfg.criteria.grad_accum_k
    if k is not None and batch % k:
        divisor = math.gcd(k, batch)
        k = divisor if divisor >= 2 else None
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, batch_size=batch),
        train=dataclasses.replace(cfg.train, grad_accum=cfg.train.grad_accum << halvings),
        criteria=dataclasses.replace(cfg.criteria, grad_accum_k=k),
    )


def record_retry(tier, cfg, configured) -> None:
    """The check and note of a retried tier's settings ``cfg`` against the ``configured`` ones."""
    was, now = configured.data.batch_size * configured.train.grad_accum, cfg.data.batch_size * cfg.train.grad_accum
    detail = (
        f"micro-batch {configured.data.batch_size} -> {cfg.data.batch_size}, accumulation "
        f"{configured.train.grad_accum} -> {cfg.train.grad_accum}: effective batch {was} -> {now}"
        + ("" if now == was else " (an odd micro-batch: the effective batch changed)")
        + (
            ""
            if cfg.criteria.grad_accum_k == configured.criteria.grad_accum_k
            else f"; the accumulation check's micro-batches {configured.criteria.grad_accum_k} -> "
            f"{cfg.criteria.grad_accum_k or 'none (not checked)'}"
        )
        + f"; ran out of memory at: {'; '.join(tier.oom_retries)}"
    )
    tier.report.notes.append(f"{tier.nodeid}: --oom-retry: {detail}")
    tier.check(RETRIED_CHECK, cfg.data.batch_size, "<", configured.data.batch_size, source="--oom-retry", detail=detail)


def retrying(test, report):
    """``test`` (a tier test function, called with its fixtures) run again after each out-of-memory while its
    micro-batch can halve (module docstring)."""
    from lora_suite.harness.cuda_errors import is_oom
    from lora_suite.harness.oom_verdict import release_gpu
    from lora_suite.measure.oom import oom_where

    @functools.wraps(test)
    def run(*args, **kwargs):
        tier = kwargs["tier"]
        while True:
            mark = report.mark()
            try:
                return test(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001  (only an out-of-memory is retried; the rest is raised as it was)
                batch = getattr(getattr(tier, "estimate_cfg", None), "data", None)
                if not is_oom(exc) or batch is None or batch.batch_size < 2:
                    raise
                tier.oom_retries.append(f"{oom_where(exc.__traceback__)} (micro-batch {batch.batch_size})")
                release_gpu(exc.__traceback__)
            report.rewind(mark)

    return run
