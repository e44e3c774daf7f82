"""The adapter's lifecycle for the implementation under test, whatever it is (``lora_suite.judges.lifecycle``): rule
sequences drawn by Hypothesis (training steps with SGD or AdamW, forwards in train and eval mode, two forwards before
one backward, a checkpointed forward, adapters rewritten in place, merge, merge again, unmerge, a forward with the
adapters disabled, the scale set by a factor, save, load into a fresh model or the same one, a cast of the whole block
to another dtype), and after every rule the model must compute the float64 function of
its current adapters, its base bitwise frozen. A failure's detail is the shrunk sequence of rules.

On a small probe block (widths 192, 128, 64, 320; 2 x 37 tokens) with base biases (without them over a 4-bit base
or where the implementation declares ``linear_bias`` not applicable: the architecture checks record that), in fp32 and
in bf16 and fp16 (over fp32 adapters where the implementation keeps them), at scales not exact in 16 bits (fp32 under
rsLoRA where the implementation has it). The rules an implementation cannot take are recorded as not applicable with its
reason: merge without ``merge_adapters``, merge and the dtype change over a base that is always 4-bit, and each optional
operation the stack does not offer (``LoRAImplementation.operation_reason``)."""

from __future__ import annotations

import pytest
import torch

from lora_suite.engine import probes as P
from lora_suite.implementations import AdapterSpec
from lora_suite.judges import lifecycle as LC

pytestmark = [pytest.mark.gpu, pytest.mark.quick]

DEV = "cuda"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# Small widths (state is what this judges; the probe grids judge the shapes), in NF4's blocks of 64 for a 4-bit base
ODD, TOKENS = P.BlockShape("lifecycle", 192, 128, 64, 320), (2, 37)
ODD_BIAS = P.BlockShape("lifecycle-bias", 192, 128, 64, 320, bias=True)  # Qwen2-like biases, kept and frozen
# Scales not exact in 16 bits: fp32 under rsLoRA where the implementation has it, s = 12/√8 = 4.2426...; the 16-bit
# dtypes s = 7.3/8 = 0.9125 (bf16 holds 0.91015625, fp16 0.9125 ± 2⁻¹¹): a scale rounded through 16 bits, or one a
# rescale recomputes as alpha/r under rsLoRA, is then off
R, ALPHA, ALPHA_16 = 8, 12.0, 7.3
OP_RULES = {
    "unmerge": "the unmerge rule",
    "disable": "the disabled-adapters rule",
    "rescale": "the rescale rule",
    "adapters": "the several-adapters rules (add, switch, delete, a name reused)",
    "combine": "the combination rule (adapters combined by weight)",
}
# The sequences of one dtype in two parts of 12, each its own test (side by side over the tier's workers): one test of
# 24 took ~27 s on an H200 (run 20261127T112541Z-quick) and set the tier's wall time (lora_suite/judges/lifecycle.py _settings).
PARTS = 2


def _quantize(impl):
    return "nf4" if impl.reason_not_applicable("bf16_base") else None  # a base that is always 4-bit: its own storage


def _adapter_dtype(impl, dtype):
    return dtype if dtype != F32 and impl.reason_not_applicable("fp32_adapters_on_16bit_base") else F32


def _left_out(impl, label: str, quantize, check) -> None:
    if quantize:
        why = f"{impl.name}'s base is always 4-bit: merging re-quantises it, and it has no other floating dtype"
        check.not_applicable(f"{label}: adapter lifecycle: the merge rule and the dtype change rule", why)
    elif why := impl.merge_reason():
        check.not_applicable(f"{label}: adapter lifecycle: the merge rule", why)
    for op, rule in OP_RULES.items():
        if (why := impl.operation_reason(op)) and not (op == "unmerge" and (quantize or impl.merge_reason())):
            check.not_applicable(f"{label}: adapter lifecycle: {rule}", why)


@pytest.mark.parametrize("part", range(PARTS), ids=lambda k: f"part{k + 1}")
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["fp32", "bf16", "fp16"])
def test_every_rule_sequence_keeps_the_function_of_the_current_adapters(dtype, part, lora_impl, check):
    label = str(dtype).removeprefix("torch.")
    quantize = _quantize(lora_impl)
    if part == 0:  # the rules left out are recorded once, by the first part
        _left_out(lora_impl, label, quantize, check)
    rslora = dtype == F32 and lora_impl.reason_not_applicable("rslora") is None
    alpha = ALPHA if dtype == F32 else ALPHA_16
    spec = AdapterSpec(P.PROBE_TARGETS, R, alpha, rslora, _adapter_dtype(lora_impl, dtype), quantize)
    shape = ODD if quantize or lora_impl.reason_not_applicable("linear_bias") else ODD_BIAS
    v = LC.run_lifecycle(lora_impl, shape, spec, dtype, DEV, tokens=TOKENS, label=label, part=(part, PARTS))
    check(v.name, v.value, v.op, v.threshold, source=v.source, detail=v.detail)
