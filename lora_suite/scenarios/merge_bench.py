"""The merge benchmark (``lora_suite/benchmarks/test_bench_merge.py``): the time to fold LoRA adapters into the base
weights, W' = W + s·B·A, and to take them out again, W = W' − s·B·A, for each implementation that can; what a user
pays to export a trained adapter, or to switch adapters while serving.

The layer: one Llama-2-7B decoder layer's seven linears in one module (``SHAPES``, configs/models/llama-2-7b.yaml),
bias-free, bf16; r = 16, alpha = 32 (s = 2), bf16 adapters (``spec_for``). Every implementation is given the same W, A,
B (seeded: W, A ~ U(±1/√in), B ~ N(0, 0.02)), so one float64 reference serves them all.

A timed call runs on a fresh copy of the saved layer (``fresh``: the adapted layer as built, never merged, deep-copied
outside the timed region, so no call runs on weights an earlier one changed), then is guarded outside it (``guard``):
with every adapter tensor the layer still holds zeroed, each projection's output on a fixed input is, after a merge,
the float64 adapted function x Wᵀ + s·(x Aᵀ) Bᵀ and, after an unmerge, the base function x Wᵀ, within the parity
tolerance the suite judges a merge by (``lora_suite.judges.parity.tolerance``: 8·(u_bf16 + u_fp32·√in), 0.031;
``layer_checks.merged``, docs/lora-spec.md MERGE). Zeroed first, as in ``invariant_checks.merge_folds``: a merge that did
nothing then gives the base function and fails; ``Reference.reach``: how far apart the two functions are, in tolerances.

Unmerge: the implementation contract has none (docs/lora-spec.md, "Not judged yet"); where the layers a merge leaves
offer PEFT's layer API (``unmerge()`` on each adapted module), it is timed on a merged copy (the merge untimed); else the
reason is recorded (lora_core's merge leaves plain linears: nothing to unmerge).

Rounds in turns (``take_rounds``): a warm-up pass, then ``ROUNDS`` rounds, each running every (implementation, kind)
``REPS`` times in an order rotated round by round (``fused_table.schedule``). A round's figure is the median of its
reps; an operation's (``figures``) the median of its rounds with their spread (p20 and p80, which ``compare`` reads; the
least and the greatest round), its per-round ratio to the torch reference's merge in the same round, and that speed
with its SE under ``speed_key``, which ``compare`` judges. The timer is injected (``cuda_event_ms`` on a GPU).
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from lora_suite.implementations.contract import AdapterSpec, ImplementationError, LoRAImplementation, adapted_modules
from lora_suite.judges.parity import compare, tolerance
from lora_suite.measure.round_spread import Spread, speedup
from lora_suite.measure.timing import PairedEstimate, TimingStats
from lora_suite.scenarios.fused_table import schedule

LAYER = "llama7b-layer-r16"
SHAPES = {  # module path -> (in, out): Llama-2-7B, hidden 4096, intermediate 11008
    "self_attn.q_proj": (4096, 4096),
    "self_attn.k_proj": (4096, 4096),
    "self_attn.v_proj": (4096, 4096),
    "self_attn.o_proj": (4096, 4096),
    "mlp.gate_proj": (4096, 11008),
    "mlp.up_proj": (4096, 11008),
    "mlp.down_proj": (11008, 4096),
}
DTYPE = torch.bfloat16
R, ALPHA = 16, 32.0  # s = alpha / r = 2
REFERENCE = "torch"  # the row every ratio is to: lora_core's merge on its torch reference backend
ROUNDS, REPS, TOKENS, SEED = 9, 5, 64, 0
B_STD = 0.02  # the suite's non-zero B (engine/benchmarking.py): the delta moves each output ~5 tolerances and more

Key = tuple[str, str]  # (implementation row, kind)


def row_id(row: str) -> str:
    """A benchmark row's parameter id, the same night to night (``compare`` pairs rows by their full name)."""
    return f"{LAYER}-{row}"


def speed_key(row: str, kind: str) -> str:
    """The ``extra_info`` key of an operation's speed against the reference's merge: both device-clocked, so the
    names end in the same mode (``-device``), which ``compare_speed_ratios`` judges rather than lists."""
    return f"{row}:{kind}-device_speed_vs_{REFERENCE}:merge-device"


def build_layer(shapes: Mapping[str, tuple[int, int]], *, device, seed: int = SEED) -> nn.Module:
    """A module holding the bias-free bf16 linears of ``shapes`` at their paths, W ~ U(±1/√in), seeded, frozen."""
    gen = torch.Generator(device=device).manual_seed(seed)
    layer = nn.Module()
    for path, (k, o) in shapes.items():
        parent = layer
        for part in path.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = parent.get_submodule(part)
        linear = nn.Linear(k, o, bias=False, device=device, dtype=DTYPE).requires_grad_(False)
        with torch.no_grad():
            linear.weight.copy_((torch.rand(o, k, generator=gen, device=device) * 2 - 1) / k**0.5)
        parent.add_module(path.rsplit(".", 1)[-1], linear)
    return layer


def draw_adapters(layer: nn.Module, r: int, *, seed: int = SEED + 1) -> dict[str, torch.Tensor]:
    """``<path>.lora_A`` (r, in) ~ U(±1/√in) and ``<path>.lora_B`` (out, r) ~ N(0, B_STD), bf16, per linear."""
    out: dict[str, torch.Tensor] = {}
    for path, m in layer.named_modules():
        if isinstance(m, nn.Linear):
            o, k = m.weight.shape
            gen = torch.Generator(device=m.weight.device).manual_seed(seed + len(out))
            a = (torch.rand(r, k, generator=gen, device=m.weight.device) * 2 - 1) / k**0.5
            b = torch.randn(o, r, generator=gen, device=m.weight.device) * B_STD
            out[f"{path}.lora_A"], out[f"{path}.lora_B"] = a.to(DTYPE), b.to(DTYPE)
    return out


@dataclass(frozen=True)
class Reference:
    """Per projection: its input (TOKENS, in), the float64 adapted function y = x Wᵀ + s·(x Aᵀ) Bᵀ and base function
    x Wᵀ, and its tolerance; ``reach``: min over projections of max|y − x Wᵀ| / max(max|y|, max|x Wᵀ|) / tol."""

    inputs: dict[str, torch.Tensor]
    adapted: dict[str, torch.Tensor]
    base: dict[str, torch.Tensor]
    tols: dict[str, float]
    reach: float


def reference(layer: nn.Module, adapters: Mapping[str, torch.Tensor], scale: float, *, tokens: int = TOKENS):
    """The float64 functions the guard judges by (``Reference``), on seeded bf16 inputs."""
    inputs: dict[str, torch.Tensor] = {}
    adapted: dict[str, torch.Tensor] = {}
    base: dict[str, torch.Tensor] = {}
    tols: dict[str, float] = {}
    reach: list[float] = []
    for path, m in layer.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        k = m.in_features
        gen = torch.Generator(device=m.weight.device).manual_seed(SEED + 100 + len(inputs))
        x = torch.randn(tokens, k, generator=gen, device=m.weight.device).to(DTYPE)
        w, a, b = (t.double() for t in (m.weight, adapters[f"{path}.lora_A"], adapters[f"{path}.lora_B"]))
        inputs[path], tols[path] = x, tolerance(DTYPE, k)
        base[path] = x.double() @ w.T
        adapted[path] = base[path] + scale * (x.double() @ a.T) @ b.T
        scale_of = max(float(adapted[path].abs().max()), float(base[path].abs().max()))
        reach.append(float((adapted[path] - base[path]).abs().max()) / scale_of / tols[path])
    return Reference(inputs, adapted, base, tols, min(reach))


def fresh(pristine: nn.Module) -> nn.Module:
    """A copy of the saved layer to run one timed call on (the saved one is never merged)."""
    return copy.deepcopy(pristine)


def guard(impl: LoRAImplementation, module: nn.Module, ref: Reference, want: str) -> list[str]:
    """The projections whose outputs, with every adapter tensor ``module`` still holds zeroed, are beyond tolerance
    of ``ref``'s ``want`` function ("adapted" after a merge, "base" after an unmerge), each described."""
    target = {"adapted": ref.adapted, "base": ref.base}[want]
    bad = []
    with torch.no_grad():
        for p in impl.adapter_parameters(module).values():
            p.zero_()
        for path, x in ref.inputs.items():
            err = compare(path, module.get_submodule(path)(x), target[path], ref.tols[path])
            if not err.ok:
                bad.append(f"not the {want} function: {err.describe()}")
    return bad


@dataclass(frozen=True)
class Op:
    """One operation to time: ``prepare`` makes the module it runs on (untimed), ``run`` is timed, ``guard`` judges
    the module afterwards (untimed): the failures, described."""

    prepare: Callable[[], nn.Module]
    run: Callable[[nn.Module], object]
    guard: Callable[[nn.Module], list[str]]


def spec_for(layer: nn.Module) -> AdapterSpec:
    """Every linear of ``layer`` by its name, r = R, alpha = ALPHA, bf16 adapters."""
    names = [n.rsplit(".", 1)[-1] for n, m in layer.named_modules() if isinstance(m, nn.Linear)]
    return AdapterSpec(tuple(dict.fromkeys(names)), r=R, alpha=ALPHA, adapter_dtype=DTYPE)


def adapted_layer(impl: LoRAImplementation, layer: nn.Module, adapters: Mapping[str, torch.Tensor]) -> nn.Module:
    """A copy of ``layer`` adapted by ``impl`` (``spec_for``) holding ``adapters``; an ImplementationError where ``impl``
    adapts other linears than the seven."""
    pristine = copy.deepcopy(layer)
    impl.inject(pristine, spec_for(layer))
    held = impl.adapter_parameters(pristine)
    if set(held) != set(adapters):
        raise ImplementationError(f"{impl.name} adapted {sorted(held)}, expected {sorted(adapters)}")
    with torch.no_grad():
        for name, p in held.items():
            p.copy_(adapters[name])
    return pristine


def unmerge_reason(impl: LoRAImplementation, pristine: nn.Module) -> str | None:
    """Why ``impl``'s merge cannot be undone here (a trial merge on a copy), or None where each adapted module
    then offers ``unmerge()`` (PEFT's layer API)."""
    merged = fresh(pristine)
    paths = adapted_modules(impl.adapter_parameters(merged))
    impl.merge_adapters(merged)
    layers = [merged.get_submodule(p) for p in paths]
    kinds = sorted({type(m).__name__ for m in layers if not callable(getattr(m, "unmerge", None))})
    if not kinds:
        return None
    return (
        f"after {impl.name}'s merge the adapted layers are {', '.join(kinds)}, with no unmerge(); the implementation "
        "contract has none (docs/lora-spec.md, Not judged yet)"
    )


def operations(impl: LoRAImplementation, pristine: nn.Module, ref: Reference) -> dict[str, Op | str]:
    """``{"merge": Op, "unmerge": Op or why there is none}`` of one implementation's saved layer."""
    paths = adapted_modules(impl.adapter_parameters(pristine))

    def merged() -> nn.Module:
        m = fresh(pristine)
        impl.merge_adapters(m)
        return m

    def unmerge(m: nn.Module) -> None:
        for p in paths:
            layer: Any = m.get_submodule(p)  # a layer with PEFT's API (unmerge_reason found it)
            layer.unmerge()

    ops: dict[str, Op | str] = {
        "merge": Op(lambda: fresh(pristine), impl.merge_adapters, lambda m: guard(impl, m, ref, "adapted"))
    }
    why = unmerge_reason(impl, pristine)
    ops["unmerge"] = why if why is not None else Op(merged, unmerge, lambda m: guard(impl, m, ref, "base"))
    return ops


@dataclass(frozen=True)
class Rounds:
    """Per operation: each measured round's figure (the median of its reps, ms) and every guard failure."""

    times: dict[Key, list[float]]
    failures: dict[Key, list[str]]


def take_rounds(ops: Mapping[Key, Op], timer: Callable[[Callable[[], object]], float], *, rounds=ROUNDS, reps=REPS):
    """One untimed warm-up pass, then ``rounds`` rounds in turns (module docstring): ``Rounds``."""
    times: dict[Key, list[float]] = {k: [] for k in ops}
    failures: dict[Key, list[str]] = {k: [] for k in ops}
    runs = [(-1, k) for k in ops] + [(r, cast(Key, k)) for _, r, k in schedule((LAYER,), list(ops), rounds=rounds)]
    for rnd, key in runs:
        label = f"round {rnd}" if rnd >= 0 else "warm-up"
        per = [_timed_call(ops[key], timer, failures[key], label) for _ in range(reps if rnd >= 0 else 1)]
        if rnd >= 0:
            times[key].append(statistics.median(per))
    return Rounds(times, failures)


def _timed_call(op: Op, timer, failures: list[str], label: str) -> float:
    """One call of ``op`` on a module of its own: its time (ms); a call the guard failed added to ``failures``."""
    module = op.prepare()
    ms = timer(lambda: op.run(module))
    bad = op.guard(module)
    if bad:  # one failure a call, naming each projection's
        failures.append(f"{label}: " + "; ".join(bad))
    return ms


def figures(times: Mapping[Key, list[float]], key: Key) -> dict[str, Any]:
    """An operation's figures for its row's ``extra_info`` (module docstring); the ratios where the reference's
    merge was measured in the same rounds (none on the reference's own merge row)."""
    own = times[key]
    stats, spread = TimingStats.from_samples(own), Spread.of(own)
    assert spread is not None  # from_samples refused no rounds
    info: dict[str, Any] = {
        "cuda_median_ms": stats.median_ms,
        "cuda_p20_ms": stats.p20_ms,
        "cuda_p80_ms": stats.p80_ms,
        "cuda_low_ms": spread.low,
        "cuda_high_ms": spread.high,
        "rounds": spread.rounds,
        "rounds_ms": list(own),
    }
    ref = times.get((REFERENCE, "merge"))
    if not ref or key == (REFERENCE, "merge") or len(ref) != len(own):
        return info
    ratios = [t / b for t, b in zip(own, ref)]
    info["ratio_to_torch_merge"] = statistics.median(ratios)
    info["ratio_to_torch_merge_low"], info["ratio_to_torch_merge_high"] = min(ratios), max(ratios)
    info["vs_torch_merge"] = speedup(ref, own).verdict
    if len(own) > 1:  # a speed's SE needs two rounds
        speed, name = PairedEstimate.of([b / t for t, b in zip(own, ref)]), speed_key(*key)
        info[name], info[f"{name}_se"] = speed.median, speed.se
    return info


def _operations_of(impl: LoRAImplementation | str, layer, adapters, ref: Reference) -> dict[str, Op | str]:
    """``operations`` of ``impl`` on its adapted copy of ``layer``, or, for each kind, why there is none."""
    reason: str | None
    if isinstance(impl, str):
        reason = impl
    else:
        reason = impl.merge_reason()
        try:
            if reason is None:
                return operations(impl, adapted_layer(impl, layer, adapters), ref)
        except ImplementationError as exc:
            reason = f"{impl.name} could not adapt the layer: {exc}"
    return {"merge": reason, "unmerge": f"no merge: {reason}"}


@dataclass(frozen=True)
class Measured:
    """What ``measure`` found: the rounds, why each operation not timed was not (``Key`` -> reason), the guard's
    reach (``Reference.reach``) and the operations timed (for the host-clocked rows of pytest-benchmark)."""

    rounds: Rounds
    not_applicable: dict[Key, str]
    reach: float
    ops: dict[Key, Op]


def measure(
    candidates: Mapping[str, LoRAImplementation | str],
    timer: Callable[[Callable[[], object]], float],
    *,
    device,
    shapes: Mapping[str, tuple[int, int]] = SHAPES,
    rounds: int = ROUNDS,
    reps: int = REPS,
    tokens: int = TOKENS,
) -> Measured:
    """Each candidate (implementation row -> implementation, or why it cannot run here) adapts the same layer and
    adapters; its merge and unmerge, where it has them, are timed in rounds in turns and guarded."""
    layer = build_layer(shapes, device=device)
    adapters = draw_adapters(layer, R)
    ref = reference(layer, adapters, ALPHA / R, tokens=tokens)
    ops: dict[Key, Op] = {}
    not_applicable: dict[Key, str] = {}
    for row, impl in candidates.items():
        for kind, op in _operations_of(impl, layer, adapters, ref).items():
            if isinstance(op, str):
                not_applicable[(row, kind)] = op
            else:
                ops[(row, kind)] = op
    return Measured(take_rounds(ops, timer, rounds=rounds, reps=reps), not_applicable, ref.reach, ops)


def cuda_event_ms(fn: Callable[[], object]) -> float:
    """``fn``'s span on the device clock, ms: the queue drained first, CUDA events around the call."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
