"""PEFT's LoraConfig options for the implementation under test (``lora_suite.judges.option_cases``: a bias on B,
``layers_to_transform``, ``modules_to_save``, embedding and LM-head targets on untied and tied scaled embeddings, the
init variants gaussian, False, PiSSA and OLoRA, DoRA) and adapters combined by weight: each option's model adapted by the stack and judged
(``lora_suite.judges.adapter_options``) for placement, its start, the function and every gradient against float64, a
step, merge and unmerge, and the round trip through its folder. An option the stack declares it lacks is recorded as
not applicable with the stack's own reason, and so is an operation within a case that it does not offer.

Each case is a 2-layer model of about 100 000 parameters in fp32: a fraction of a second each on a GPU."""

from __future__ import annotations

import pytest

from lora_suite.judges import adapter_options as AO
from lora_suite.judges import combined_adapters as CA
from lora_suite.judges.option_cases import OPTIONS

pytestmark = [pytest.mark.gpu, pytest.mark.quick, pytest.mark.model_code]  # builds transformers models

DEV = "cuda"
TABLE = ("option", "feature", "architecture", "checks", "checks failed")


@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_is_built_computed_trained_merged_and_saved_as_set(name, lora_impl, check, run_report, request):
    option = OPTIONS[name]
    if why := AO.not_applicable_reason(lora_impl, name):
        check.not_applicable(f"{name}: every check of this option", why)
        return
    verdicts, skipped = AO.judge(lora_impl, name, DEV)
    for op, why in skipped:
        check.not_applicable(f"{name}: the function after {op}", why)
    for v in verdicts:
        check(v.name, v.value, v.op, v.threshold, source=v.source, detail=v.detail)
    failed = [v.name for v in verdicts if not v.passed]
    row = (name, option.feature, option.arch, len(verdicts), "; ".join(failed) or "-")
    run_report.add_row(request.node.nodeid, f"adapter options ({lora_impl.name})", TABLE, row)


def test_adapters_combined_by_weight_compute_the_weighted_sum(lora_impl, check):
    """``lora_suite.judges.combined_adapters``: two adapters combined (PEFT's add_weighted_adapter, 'cat')."""
    if why := CA.not_applicable_reason(lora_impl):
        check.not_applicable("combined adapters: every check of the combination", why)
        return
    for v in CA.judge(lora_impl, DEV):
        check(v.name, v.value, v.op, v.threshold, source=v.source, detail=v.detail)
