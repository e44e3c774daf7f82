"""Adapters combined by weight (PEFT's ``add_weighted_adapter``, combination ``cat``), for any implementation that
holds several adapters and offers ``combine_adapters``.

Two adapters on a 2-layer Llama (q, v, down: square and non-square), both randomised through the stack's own switch
(``set_active_adapter`` then ``adapter_parameters``), combined with weights 0.7 and −1.3 into a third; with that one
active the model must compute the float64 function of

    W' = W + Σᵢ wᵢ · sᵢ · Bᵢ · Aᵢ

(``cat`` stacks the sources' ranks, so the sum is exact: the new adapter's own scale must be 1, whatever the sources'
scaling rule), and the sources must come out of the combination bitwise as they went in. Under rsLoRA where the stack
has it (sᵢ = alpha/√r): a combined adapter that inherits rsLoRA scales its update by √(Σ rᵢ) (peft PR #3449).
Tolerance: ``model_function.model_tolerance``'s error model for the architecture in fp32.
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from lora_suite.engine.architectures import ARCHITECTURES
from lora_suite.implementations import AdapterSpec
from lora_suite.judges.layer_checks import none_of
from lora_suite.judges.model_function import arch_tolerance
from lora_suite.judges.option_cases import adapt
from lora_suite.judges.parity import compare
from lora_suite.measure.criteria import Verdict

TARGETS, R, ALPHA = ("q_proj", "v_proj", "down_proj"), 4, 7.0
WEIGHTS = {"default": 0.7, "other": -1.3}
SOURCE = "W' = W + Σ wᵢ·sᵢ·Bᵢ·Aᵢ (PEFT's add_weighted_adapter, 'cat'); combined_adapters.py"


def not_applicable_reason(impl) -> str | None:
    """Why the combination is not judged on ``impl``: it holds one adapter, offers no combination, or its
    architecture's float64 reference does not run beside it."""
    from lora_suite.judges.model_function import unquantised_reason as arch_reason

    for op in ("adapters", "combine"):
        if why := impl.operation_reason(op):
            return why
    return arch_reason(impl, ARCHITECTURES["llama"])


def judge(impl, device, *, seed: int = 0) -> list[Verdict]:
    arch = ARCHITECTURES["llama"]
    spec = AdapterSpec(TARGETS, R, ALPHA, impl.reason_not_applicable("rslora") is None, torch.float32)
    model, reference = adapt(impl, arch, spec, device, seed)
    impl.add_named_adapter(model, "other", spec)
    gen = torch.Generator().manual_seed(seed + 1)
    sources = {}
    with torch.no_grad():
        for name in WEIGHTS:
            impl.set_active_adapter(model, name)
            for p in impl.adapter_parameters(model).values():
                p.copy_(torch.randn(p.shape, generator=gen).to(p.device, p.dtype) * p.shape[-1] ** -0.5)
            sources[name] = {n: p.detach().clone() for n, p in impl.adapter_parameters(model).items()}
    impl.set_active_adapter(model, "default")
    impl.combine_adapters(model, list(WEIGHTS), list(WEIGHTS.values()), "combined")
    changed = []
    for name, before in sources.items():
        impl.set_active_adapter(model, name)
        now = impl.adapter_parameters(model)
        changed += [f"{name}: {n}" for n, t in before.items() if n not in now or not torch.equal(now[n].detach(), t)]
    impl.set_active_adapter(model, "combined")
    ids = torch.randint(0, arch.config().vocab_size, (2, 12), generator=gen).to(device)
    with torch.no_grad():
        got = model(ids).logits
        want = _reference(reference, sources, spec, ids)
    err = compare("logits", got, want, arch_tolerance(arch, torch.float32, ids.numel()))
    return [
        none_of(
            "combined adapters: logits beyond tolerance of W + Σ wᵢ·sᵢ·Bᵢ·Aᵢ",
            [] if err.ok else [err.describe()],
            SOURCE + ("; under rsLoRA" if spec.use_rslora else ""),
        ),
        none_of("combined adapters: source adapters changed by the combination", changed, SOURCE, shown=4),
    ]


def _reference(reference, sources: dict[str, dict[str, torch.Tensor]], spec: AdapterSpec, ids) -> torch.Tensor:
    weights = {}
    for path in dict.fromkeys(n.rsplit(".", 1)[0] for n in sources["default"]):
        s = spec.scale_of(path.rsplit(".", 1)[-1])
        delta = sum(
            WEIGHTS[name] * s * t[f"{path}.lora_B"].double() @ t[f"{path}.lora_A"].double()
            for name, t in sources.items()
        )
        weights[f"{path}.weight"] = reference.get_parameter(f"{path}.weight") + delta
    return functional_call(reference, weights, (ids,)).logits
