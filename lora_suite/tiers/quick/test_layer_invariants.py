"""The invariants of a correct LoRA layer that the parity grid cannot see, for the implementation under test whatever it
is (``docs/lora-spec.md`` gives each one's source; ``lora_suite.judges.invariant_checks`` computes them):

- the initial state as ``inject`` leaves it (the grid randomises the adapters first): the base model's function,
  adapters that can learn;
- the scale s = alpha / r with alpha not a multiple of r, and rsLoRA's alpha / √r (outputs, gradients and the merge);
- adapters in the requested dtype; only the adapters trainable; targets that name no layer refused; inputs never
  written; several forwards before one
  backward; activation checkpointing in both of torch's modes;
- one implementation object adapting two models: each keeps its own settings and state.

Each costs well under a second on a GPU. What the implementation declares it cannot do is recorded as not applicable
with its own reason."""

from __future__ import annotations

import pytest
import torch

from lora_suite.engine import probes as P
from lora_suite.implementations import AdapterSpec
from lora_suite.judges import init_spread as IS
from lora_suite.judges import invariant_checks as I
from lora_suite.judges import layer_checks as L
from lora_suite.judges import name_collisions as NC
from lora_suite.judges import probe_judge as PJ
from lora_suite.judges import two_models as TM

pytestmark = [pytest.mark.gpu, pytest.mark.quick]

DEV = "cuda"
F32, BF16 = torch.float32, torch.bfloat16
SMALL, ODD = P.BlockShape("smollm2", 576, 576, 192, 1536), P.BlockShape("odd", 333, 1000, 37, 1001)
# alpha = 12 over r = 8 (s = 1.5, no whole-number ratio: integer division or a scale of 1 or 2 shows), and rsLoRA at
# r = 16 (alpha / sqrt(r) = 3 where alpha / r would be 0.75)
SCALINGS = {"scale alpha/r=12/8": (8, 12.0, False), "rsLoRA alpha/sqrt(r)=12/4": (16, 12.0, True)}


def _quantize(impl):
    return "nf4" if impl.reason_not_applicable("bf16_base") else None  # a base that is always 4-bit: its own storage


def _adapter_dtype(impl, dtype):
    return dtype if dtype != F32 and impl.reason_not_applicable("fp32_adapters_on_16bit_base") else F32


def _probe(
    impl, shape=ODD, dtype=BF16, *, r=8, alpha=16.0, rslora=False, adapter_dtype="default", seed=0, **kw
) -> tuple[P.Probe, P.ProbeInputs]:
    adapter_dtype = _adapter_dtype(impl, dtype) if adapter_dtype == "default" else adapter_dtype
    spec = AdapterSpec(P.PROBE_TARGETS, r, alpha, rslora, adapter_dtype, _quantize(impl))
    probe = P.build_probe(impl, shape, spec, dtype, DEV, seed=seed, **kw)
    return probe, P.random_inputs(shape, (2, 37), dtype, DEV, seed=seed + 1)


def _record(check, v):
    check(v.name, v.value, v.op, v.threshold, source=v.source, detail=v.detail)


def test_initial_adapters_give_the_base_function_and_can_learn(lora_impl, check):
    for shape in (SMALL, ODD):
        _record(check, I.initial_outputs(*_probe(lora_impl, shape, F32, randomise=False)))
        _record(check, I.initial_gradients(*_probe(lora_impl, shape, BF16, randomise=False)))
    name = "at initialisation: A not U(±1/√in) or B not zero (PEFT's default init; of {} tensors)"
    if why := lora_impl.reason_not_applicable("peft_default_init"):
        check.not_applicable(name.format("N"), why)
    else:
        _record(check, IS.initial_spread(lora_impl, DEV))


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_scaling_follows_alpha_and_rank(scaling, lora_impl, check):
    r, alpha, rslora = SCALINGS[scaling]
    if rslora and (why := lora_impl.reason_not_applicable("rslora")):
        check.not_applicable(f"{scaling}: every check of the rsLoRA scale", why)
        return
    cases = []
    for dtype in (F32, BF16):
        for i, shape in enumerate((SMALL, ODD)):
            probe, inputs = _probe(lora_impl, shape, dtype, r=r, alpha=alpha, rslora=rslora, seed=i)
            got, errs = L.parity_errors(probe, inputs)
            cases.append((f"{shape.name} {str(dtype)[6:]}", errs, PJ.dtype_errors(probe, inputs, got)))
    for v in L.parity_verdicts(scaling, cases):
        _record(check, v)
    merged = f"{scaling}: merged weights: outputs beyond tolerance (of {len(P.OUTPUTS)})"
    why = lora_impl.merge_reason() or (
        f"{lora_impl.name}'s base is always 4-bit: merging re-quantises it" if _quantize(lora_impl) else None
    )
    if why:
        check.not_applicable(merged, why)
        return
    v = L.merged(*_probe(lora_impl, ODD, BF16, r=r, alpha=alpha, rslora=rslora, seed=7))
    check(merged, v.value, v.op, v.threshold, source=v.source, detail=v.detail)


def test_adapters_are_made_in_the_requested_dtype(lora_impl, check):
    wanted = [BF16] if lora_impl.reason_not_applicable("fp32_adapters_on_16bit_base") else [F32, BF16]
    for adapter_dtype in wanted:
        probe, _ = _probe(lora_impl, ODD, BF16, adapter_dtype=adapter_dtype)
        _record(check, I.adapter_dtypes(probe))


def test_only_the_adapters_train_and_inputs_are_never_written(lora_impl, check):
    _record(check, I.frozen_base(*_probe(lora_impl)))
    spec = AdapterSpec(P.PROBE_TARGETS, 8, 16.0, False, _adapter_dtype(lora_impl, BF16), _quantize(lora_impl))
    _record(check, I.unmatched_targets(lora_impl, ODD, spec, BF16, DEV))
    _record(check, I.inputs_untouched(*_probe(lora_impl)))


def test_several_forwards_before_one_backward(lora_impl, check):
    probe, inputs = _probe(lora_impl)
    other = P.random_inputs(probe.shape, (2, 37), BF16, DEV, seed=55)
    _record(check, I.several_forwards(probe, inputs, other))


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing_gives_the_plain_gradients(use_reentrant, lora_impl, check):
    _record(check, I.checkpointed(*_probe(lora_impl), use_reentrant))


def test_one_implementation_adapts_two_models_apart(lora_impl, check, tmp_path):
    """State across models: one implementation object adapting two models with different settings (two_models.py)."""
    _record(check, TM.two_models(lora_impl, SMALL, BF16, DEV, tmp_path, adapter_dtype=_adapter_dtype(lora_impl, BF16)))


def test_modules_named_like_the_words_of_adapter_keys_keep_their_own_adapters(lora_impl, check):
    """A block of linears named weight, bias, default, base_layer, lora_x, q and q_proj, all targeted
    (``lora_suite.judges.name_collisions``): each adapted once, the base frozen, the float64 function, the round trip
    bitwise; a stack whose inject refuses such names is recorded not applicable in its own words."""
    verdicts, refused = NC.name_collisions(lora_impl, DEV)
    if refused:
        check.not_applicable(f"{NC.LABEL}: every check", refused)
    for v in verdicts:
        check(v.name, v.value, v.op, v.threshold, source=v.source, detail=v.detail)
