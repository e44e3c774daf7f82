"""The whole-model criterion, for any architecture (``lora_suite.engine.architectures``) and any implementation: the
adapted model computes the *base* model's function with every adapted weight W replaced by W' = W + s·B·A.

How it is judged (``build_case``, then the verdict functions, each returning ``Verdict``s):

- the reference is a float64 copy of the un-adapted model, taken before ``inject`` (same weights, biases, norms, the
  tied embedding one tensor); the adapters are read through the contract (``adapter_parameters``) and set to random
  values first (A std 1/√in, B std 1/√r: B non-zero, so that dA matters), each rounded to the activation dtype as
  ``lora_suite.judges.probe_judge.reference`` does;
- forward: the same input ids through both, logits compared (``torch.func.functional_call`` puts W' in place of each
  adapted weight of the copy, nothing else changes); backward: the same upstream gradient G of the logits
  (L = Σ logits ⊙ G), and from autograd's dL/dW' through the float64 copy

      dL/dA = s·Bᵀ·(dL/dW'),    dL/dB = s·(dL/dW')·Aᵀ

  against the implementation's adapter gradients, name by name;
- targets: every linear of the base model whose leaf name is a target is adapted (``adapter_parameters`` names it);
- frozen base: after ``inject`` nothing but the adapters is trainable; after the backward no other parameter holds a
  gradient; after one SGD step over whatever is trainable (as a trainer over ``model.parameters()`` takes it) every
  base weight and bias is bitwise what it was, and the model computes the float64 function of its new adapters.

Tolerance (``model_tolerance``): the parity error model (``lora_suite.judges.parity.tolerance``: 8·(u_dtype +
u_fp32·√k), k the longest inner dimension) for one LoRA linear, times ``STAGES_PER_LAYER`` for each decoder layer
and once more for the LM head: a layer's chain stores rounded intermediates in two sub-blocks (attention: q/k/v,
scores, the softmax-weighted sum, o; MLP: ``parity.MLP_STAGES``), each within one linear's bound of its own scale,
and the RMSNorm between layers renormalises the scale (unit-variance activations throughout: the init of
``architectures``). Gradients traverse the chain twice (recomputation and its transpose): twice the bound. An fp32
model is judged at fp32-level error (about 1e-4 for these widths); a dropped bias, a scale applied twice or a
missing adapter moves logits by order 0.1 to 1 of their scale.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from lora_suite.engine.architectures import Architecture
from lora_suite.engine.prepare import with_experts
from lora_suite.engine.probes import spec_scale
from lora_suite.implementations import AdapterSpec, ExpertAdapter, LoRAImplementation, adapted_modules
from lora_suite.judges import stack_reference
from lora_suite.judges.layer_checks import none_of
from lora_suite.judges.parity import MLP_STAGES, compare, tolerance
from lora_suite.judges.reference_math import FunctionRun, reference_factors, reference_math
from lora_suite.measure.criteria import Verdict

if TYPE_CHECKING:
    from transformers import PreTrainedModel

R, ALPHA = 8, 12.0  # s = 1.5: not a whole number, so a scale of 1 or 2, or alpha // r, shows
BATCH, SEQ = 2, 12  # 12 tokens: beyond Mistral's sliding window of 8 in architectures.py
STAGES_PER_LAYER = 2 * MLP_STAGES  # attention and MLP sub-blocks, each of up to MLP_STAGES stored roundings
STEP_LR = 0.5  # one SGD step large enough that a moved bias or weight is far beyond any tolerance
SOURCE = "W' = W + s·B·A in a float64 copy of the base; tol = parity.tolerance x 6 per layer (+1); model_function.py"
FROZEN_SOURCE = "LoRA §4: W0 frozen (weights and biases), only A and B trained; PEFT bias='none'"
WHOLE = (
    "linear_bias",
    "fused_projections",
    "gated_gelu_mlp",
)  # features an architecture needs of a stack before any check applies


def four_bit(impl: LoRAImplementation) -> bool:
    """Whether ``impl``'s base is always 4-bit (``bf16_base`` not applicable): its cases are built in fp32 and
    quantised to NF4 by the stack (compute in fp32), the reference read from its layers (``stack_reference``)."""
    return impl.reason_not_applicable("bf16_base") is not None


def not_applicable_reason(impl: LoRAImplementation, arch: Architecture) -> str | None:
    """Why no check of ``arch`` applies to ``impl`` (a feature it needs, as the implementation declares it), or None.
    A stack whose base is always 4-bit needs an NF4 base it can build (``nf4_base``)."""
    needed = [f for f in arch.features() if f in WHOLE] + (
        [] if impl.separate_reference else ["float64_reference_model"]
    )
    needed += ["nf4_base"] if four_bit(impl) else []
    whys = [f"{f}: {why}" for f in needed if (why := impl.reason_not_applicable(f))]
    return "; ".join(whys) or None


def unquantised_reason(impl: LoRAImplementation, arch: Architecture) -> str | None:
    """``not_applicable_reason`` for checks whose models stay unquantised fp32 (the options, the combination): a
    stack whose base is always 4-bit (``bf16_base``) says so too."""
    whys = [why] if (why := not_applicable_reason(impl, arch)) else []
    if impl.separate_reference and (why := impl.reason_not_applicable("float64_reference_model")):
        whys.append(f"float64_reference_model: {why} (these checks' references run in the test's process)")
    if why := impl.reason_not_applicable("bf16_base"):
        whys.insert(0, f"bf16_base: {why} (these models are unquantised fp32)")
    return "; ".join(whys) or None


def expert_reason(impl: LoRAImplementation, arch: Architecture) -> str | None:
    """Why ``arch``'s expert parameters are not adapted by ``impl`` (None: it has none, or the stack adapts them)."""
    return impl.reason_not_applicable("moe_experts") if arch.parameter_targets else None


@dataclass
class ArchCase:
    """One architecture adapted by one implementation, with what the criterion compares it against."""

    arch: Architecture
    impl: LoRAImplementation
    model: nn.Module
    reference: nn.Module  # float64 copy of the base model, no gradients of its own
    # name -> (the trained model's base tensor, None where its loader lost it; a copy of the built one)
    base: dict[str, tuple[torch.Tensor | None, torch.Tensor]]
    expected: list[str]  # module paths of the base model's target linears
    adapters: dict[str, nn.Parameter]
    scale: float
    ids: torch.Tensor
    dlogits: torch.Tensor
    spec: AdapterSpec
    experts: dict[str, ExpertAdapter] = field(default_factory=dict)  # 3-D expert parameters adapted (MoE)
    built: dict[str, torch.Tensor] | None = None  # a 4-bit base: the weights the suite built, before quantisation
    names: stack_reference.ModelingNames | None = None  # the modeling module's names before inject (as_built)

    def trained(self) -> dict[str, nn.Parameter]:
        """Every adapter tensor: the linears' A and B and each expert adapter's (by ``<parameter>.lora_A``/``_B``)."""
        return with_experts(self.adapters, self.experts)

    @property
    def dtype(self) -> torch.dtype:
        # Architecture.build gives a transformers model; the implementations adapt it in place or load one
        weight = cast("PreTrainedModel", self.model).get_input_embeddings().weight
        assert isinstance(weight, torch.Tensor), "an embedding's weight is a parameter"
        return weight.dtype


def build_case(impl, arch: Architecture, dtype: torch.dtype, device, *, seed: int = 0, adapter_dtype=None) -> ArchCase:
    """``arch`` built from ``seed``, copied in float64, adapted by ``impl`` on its linear targets (``adapter_dtype``:
    fp32 where None), the adapters randomised; random ids and an upstream gradient of the logits."""
    model = arch.build(dtype, device, seed=seed)
    names = stack_reference.ModelingNames.of(model)  # transformers' code as built, before a stack patches it
    reference = copy.deepcopy(model).double().requires_grad_(False)
    built = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = [
        p for p, m in model.named_modules() if isinstance(m, nn.Linear) and p.rsplit(".", 1)[-1] in arch.targets
    ]
    experts = () if expert_reason(impl, arch) else arch.parameter_targets
    quantize = "nf4" if four_bit(impl) else None
    spec = AdapterSpec(
        arch.targets, R, ALPHA, False, adapter_dtype or torch.float32, quantize, target_parameters=experts
    )
    torch.manual_seed(seed)  # an implementation's own random init is the same for the same seed
    model = impl.load_model(model, spec)  # a stack with its own loader trains the model it read back
    live = dict(model.named_parameters())
    base = {n: (live.get(n), before.to(live[n].device) if n in live else before) for n, before in built.items()}
    impl.inject(model, spec)
    impl.finish_model(model, spec)  # the whole model, as prepare() gives it to a tier
    adapters, held = impl.adapter_parameters(model), impl.expert_adapters(model)
    if quantize:  # the base as the stack's 4-bit layers compute with it
        reference = stack_reference.effective_copy(arch, model, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in adapters.values():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
        for ex in held.values():  # per expert: A std 1/√in, B std 1/√r, as for a linear
            for p, view in ((ex.a, ex.a3), (ex.b, ex.b3)):
                p.copy_(torch.randn(p.shape, generator=gen) * view(p).shape[-1] ** -0.5)
    vocab = arch.config().vocab_size
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen).to(device)
    dlogits = torch.randn(BATCH, SEQ, vocab, generator=gen).to(device)
    case = ArchCase(
        arch, impl, model.train(), reference, base, expected, adapters, spec_scale(spec), ids, dlogits, spec, held
    )
    case.names = names
    if quantize:  # the 4-bit layers' codes as the base a step must leave alone; the built weights for nf4_verdict
        case.base = {n: (p, p.detach().clone()) for n, p in _base_params(case).items()}
        case.built = built
    return case


def run_model(case: ArchCase) -> FunctionRun:
    """The implementation's logits and adapter gradients for L = Σ logits ⊙ G (gradients set afresh)."""
    for p in case.model.parameters():
        p.grad = None
    logits = case.model(case.ids).logits
    (logits * case.dlogits.to(logits.dtype)).sum().backward()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in case.adapters.items()}
    for name, ex in case.experts.items():  # per expert, through the stack's own layout
        for end, p, view in (("lora_A", ex.a, ex.a3), ("lora_B", ex.b, ex.b3)):
            grads[f"{name}.{end}"] = None if p.grad is None else view(p.grad.detach()).clone()
    return FunctionRun(logits.detach(), grads)


def reference_run(case: ArchCase, *, backward: bool = True) -> FunctionRun:
    """The float64 function of the adapted base (module docstring): W' = W + s·B̂·Â at each adapted path; in a fresh
    process for a stack that patches transformers for the whole process (``separate_reference``)."""
    if case.impl.separate_reference:
        from lora_suite.judges import separate_reference

        return separate_reference.run(case, backward=backward)
    return reference_math(
        case.reference, *reference_factors(case), case.scale, case.ids, case.dlogits, backward, case.names
    )


def model_tolerance(case: ArchCase) -> float:
    """One LoRA linear's parity bound × the stages of the whole model (module docstring)."""
    return arch_tolerance(case.arch, case.dtype, case.ids.numel())


def arch_tolerance(arch: Architecture, dtype: torch.dtype, tokens: int) -> float:
    """``model_tolerance`` of ``arch`` in ``dtype`` over ``tokens`` input tokens, for any case built on it."""
    cfg = arch.config()
    k = max(cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, tokens)
    return tolerance(dtype, k) * (STAGES_PER_LAYER * cfg.num_hidden_layers + 1)


def targets_adapted(case: ArchCase) -> Verdict:
    """Every target linear of the base model has adapters under its own path."""
    got = set(adapted_modules(case.adapters))
    missing = [p for p in case.expected if p not in got]
    if case.spec.target_parameters:  # every expert parameter of a target leaf name
        leaves = set(case.spec.target_parameters)
        params = [n for n, p in case.reference.named_parameters() if p.dim() == 3 and n.rsplit(".", 1)[-1] in leaves]
        missing += [f"{n} (expert parameter)" for n in params if n not in case.experts]
        missing += [f"{n}: {why}" for n, ex in case.experts.items() if (why := _expert_shape(case, n, ex))]
    return none_of(
        f"{case.arch.name}: target projections left without adapters (of {len(case.expected)})",
        missing,
        "AdapterSpec.targets: every linear whose leaf name is a target (PEFT target_modules)",
        sep=", ",
        shown=4,
    )


def _expert_shape(case: ArchCase, name: str, ex: ExpertAdapter) -> str | None:
    """What is wrong with the factor shapes of the expert adapter ``name`` (A (E, r, d₂), B (E, d₁, r) for W (E, d₁,
    d₂), r the spec's rank of its leaf name), or None."""
    e, d1, d2 = case.reference.get_parameter(name).shape
    r = case.spec.rank_of(name.rsplit(".", 1)[-1])
    a3, b3 = ex.factors()
    if tuple(a3.shape) != (e, r, d2) or tuple(b3.shape) != (e, d1, r):
        return f"factors A {tuple(a3.shape)}, B {tuple(b3.shape)}, expected ({e}, {r}, {d2}) and ({e}, {d1}, {r})"
    return None


def _base_params(case: ArchCase) -> dict[str, nn.Parameter]:
    ids = {id(p) for p in case.trained().values()}
    return {n: p for n, p in case.model.named_parameters() if id(p) not in ids}


def function_verdicts(case: ArchCase) -> list[Verdict]:
    """Logits and adapter gradients against the float64 adapted model, and the base frozen through the backward
    (nothing but the adapters trainable, no other parameter given a gradient)."""
    name, tol = case.arch.name, model_tolerance(case)
    base = _base_params(case)
    trainable = [f"{n} trainable" for n, p in base.items() if p.requires_grad]
    got, want = run_model(case), reference_run(case)
    graded = [f"{n} got a gradient" for n, p in base.items() if p.grad is not None]
    logits = compare("logits", got.logits, want.logits, tol)
    assert all(r is not None for r in want.grads.values()), "reference_run gives every adapter a gradient"
    errs = [compare(n, got.grads.get(n), r, 2 * tol) for n, r in want.grads.items() if r is not None]
    return [
        none_of(
            f"{name}: logits beyond tolerance of the float64 adapted model",
            [] if logits.ok else [logits.describe()],
            SOURCE,
        ),
        none_of(
            f"{name}: adapter gradients beyond tolerance of the float64 adapted model (of {len(errs)})",
            [e.describe() for e in errs if not e.ok],
            SOURCE + "; x2 for the backward",
            shown=4,
        ),
        none_of(
            f"{name}: base weights or biases trainable or given a gradient (of {len(base)})",
            trainable + graded,
            FROZEN_SOURCE,
            shown=4,
        ),
    ]


def step_verdicts(case: ArchCase) -> list[Verdict]:
    """One SGD step (lr ``STEP_LR``) over every trainable parameter, from the gradients ``function_verdicts`` left:
    every base tensor bitwise as before ``inject``, and the model then the float64 function of its new adapters."""
    name = case.arch.name
    with torch.no_grad():
        for p in case.model.parameters():
            if p.requires_grad and p.grad is not None:
                p.add_(p.grad, alpha=-STEP_LR)
    moved = [
        n if t is not None else f"{n} (not in the model the loader returned)"
        for n, (t, before) in case.base.items()
        if t is None or not torch.equal(t.detach(), before)
    ]
    with torch.no_grad():
        got = case.model(case.ids).logits
    logits = compare("logits", got, reference_run(case, backward=False).logits, model_tolerance(case))
    return [
        none_of(
            f"{name}: base weights or biases changed by a training step (of {len(case.base)})",
            moved,
            FROZEN_SOURCE + "; an optimizer over model.parameters() moves whatever is trainable",
            sep=", ",
            shown=4,
        ),
        none_of(
            f"{name}: after a step, logits beyond tolerance of the float64 adapted model",
            [] if logits.ok else [logits.describe()],
            SOURCE,
        ),
    ]


def judge(impl, arch: Architecture, dtype: torch.dtype, device, *, seed: int = 0) -> list[Verdict]:
    """Every verdict of ``arch`` for ``impl`` (its applicability checked by the caller: ``not_applicable_reason``)."""
    case = build_case(impl, arch, dtype, device, seed=seed)
    nf4 = [stack_reference.nf4_verdict(arch.name, case.built, case.reference, dtype)] if case.built else []
    return [targets_adapted(case), *nf4, *function_verdicts(case), *step_verdicts(case)]
