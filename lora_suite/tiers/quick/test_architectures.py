"""Every architecture family people fine-tune (``lora_suite.engine.architectures``: Llama, Qwen2 with q/k/v biases,
Qwen3 with q/k norms, Gemma 2 with tied embeddings and soft-capping, Mistral, Phi-3 with fused projections, Qwen3-MoE)
x the implementation under test: the whole adapted model against the float64 function of the base with W + s·B·A in
place of each adapted weight, its base weights and biases frozen and untouched by a step, every target adapted
(``lora_suite.judges.model_function``). A family the implementation declares it cannot adapt is recorded as not
applicable with its own reason; so are the MoE's expert parameters where the stack does not adapt them. Where it
does (PEFT's ``target_parameters``), every expert's W + s·Bₑ·Aₑ is in the function, and routing, merge and round trip
of the expert adapters are judged (``lora_suite.judges.expert_adapters``).

Each family is a 2-layer model of about 100 000 parameters in fp32 (judged at fp32-level error): well under a second
each on a GPU."""

from __future__ import annotations

import pytest
import torch

from lora_suite.engine.architectures import ARCHITECTURES
from lora_suite.judges import expert_adapters as EA
from lora_suite.judges import model_function as MF

pytestmark = [pytest.mark.gpu, pytest.mark.quick, pytest.mark.model_code]  # builds transformers models

DEV = "cuda"
TABLE = ("architecture", "targets", "biased projections", "tied embeddings", "checks failed")


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_computes_the_adapted_base_function(name, lora_impl, check, run_report, request):
    arch = ARCHITECTURES[name]
    if why := MF.expert_reason(lora_impl, arch):
        check.not_applicable(f"{name}: expert parameters {', '.join(arch.parameter_targets)} adapted", why)
    if why := MF.not_applicable_reason(lora_impl, arch):
        check.not_applicable(f"{name}: every check of this architecture", why)
        return
    verdicts = MF.judge(lora_impl, arch, torch.float32, DEV)
    if arch.parameter_targets and not MF.expert_reason(lora_impl, arch):  # routing, merge, round trip of experts
        experts, why = EA.judge(lora_impl, arch, torch.float32, DEV)
        verdicts += experts
        if why:
            check.not_applicable(f"{name}: merged experts, logits beyond tolerance of the float64 adapted model", why)
    for v in verdicts:
        check(v.name, v.value, v.op, v.threshold, source=v.source, detail=v.detail)
    failed = [v.name for v in verdicts if not v.passed]
    row = (name, ", ".join(arch.targets), ", ".join(arch.biased) or "-", arch.tied, "; ".join(failed) or "-")
    run_report.add_row(request.node.nodeid, f"architectures ({lora_impl.name})", TABLE, row)
