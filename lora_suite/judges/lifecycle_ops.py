"""The lifecycle's rules for the operations a user calls on an adapted model beyond training (``OPERATIONS`` of the
contract: merge again, unmerge, the adapters disabled for a block, the scale set by a factor, several adapters added,
switched and deleted, adapters combined by weight), each a function of the ``lifecycle_state.Lifecycle`` it changes, raising ``LifecycleBroken``
where the stack leaves the function of its current adapters (the check after each rule judges the rest)."""

from __future__ import annotations

import dataclasses

import torch

from lora_suite.engine import probes as P
from lora_suite.judges import probe_judge as PJ
from lora_suite.judges.lifecycle_state import Lifecycle, LifecycleBroken, describe


class _RaisedInside(Exception):
    """Raised inside ``disabled_adapters`` by the rule that checks an exception restores the adapters."""


def merge_again(life: Lifecycle) -> None:
    """``merge_adapters`` on a merged model: nothing is folded twice (the merged weights stay bitwise as they are)."""
    life.build.impl.merge_adapters(life.probe.block)


def unmerge(life: Lifecycle) -> None:
    """``unmerge_adapters``: the adapters apply again, bitwise the ones folded, and the base weights are W₀ again
    within the rounding of one merge and one unmerge (judged through the function: the reference keeps W₀)."""
    assert life.merged is not None, "an unmerge follows a merge"
    life.build.impl.unmerge_adapters(life.probe.block)
    folded, life.merged, life.unmerged = life.merged, None, True
    live = life.live()
    bad = [n for n, t in folded.items() if n not in live or not torch.equal(live[n].detach(), t)]
    if bad:
        raise LifecycleBroken(f"unmerge: adapters not the ones the merge folded: {describe(bad)}")
    life.frozen = life.snapshot()  # W₀ + ΔW − ΔW as rounded: untouched from now on


def disabled_forward(life: Lifecycle, seed: int, raise_inside: bool) -> None:
    """A forward inside ``disabled_adapters`` (and, with ``raise_inside``, an exception raised in the block and
    caught outside it): the base function there; the adapters apply again after it (the check after the rule)."""
    inputs = life.build.inputs(seed, life.dtype)
    base = dataclasses.replace(life.reference_probe(), adapters={})
    ref = PJ.reference(base, inputs, inputs_require_grad=False, backward=False)
    got = None
    try:
        with life.build.impl.disabled_adapters(life.probe.block):
            got = P.run_probe(life.run_probe(), inputs, inputs_require_grad=False, backward=False)
            if raise_inside:
                raise _RaisedInside
    except _RaisedInside:
        pass
    assert got is not None, "the forward ran inside the block"
    life.judge("forward with the adapters disabled (the base function)", inputs, got, ref, base)


def rescale(life: Lifecycle, factor: float) -> None:
    """``set_adapter_scale(factor)``: the model's scale is ``factor`` times the spec's from now on (not compounded
    with an earlier factor)."""
    life.build.impl.set_adapter_scale(life.probe.block, factor)
    life.factors = dict.fromkeys(life.present, factor)


def add_adapter(life: Lifecycle, name: str, seed: int) -> None:
    """``add_named_adapter(name)`` (deleted first if the model holds it: a name reused), its tensors then set to
    new values through the stack's own switch (set active, written in place, the previous one active again): the
    active adapter and its function unchanged, the new one frozen and untouched from now on."""
    impl, block = life.build.impl, life.probe.block
    if name in life.present:
        impl.delete_named_adapter(block, name)
        life.present.remove(name)
    impl.add_named_adapter(block, name, life.build.spec)
    life.present.append(name)
    life.factors[name], life.scales[name] = 1.0, life.probe.scale
    impl.set_active_adapter(block, name)
    life.rewrite(seed)
    impl.set_active_adapter(block, life.active)
    life.frozen = life.snapshot()


def switch_adapter(life: Lifecycle, name: str) -> None:
    """``set_active_adapter(name)``: the model computes and trains that adapter, the others frozen."""
    life.build.impl.set_active_adapter(life.probe.block, name)
    life.active = name
    life.frozen = life.snapshot()


def delete_adapter(life: Lifecycle, name: str) -> None:
    """``delete_named_adapter`` of an inactive adapter: gone, the active one's function unchanged."""
    life.build.impl.delete_named_adapter(life.probe.block, name)
    life.present.remove(name)
    del life.factors[name], life.scales[name]
    life.frozen = life.snapshot()


COMBINED = "combined"  # the name the combination rule gives its adapter (reused: deleted first when inactive)


def _updates(life: Lifecycle) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per adapted module of the active adapter, (s·B·A, s·|B|·|A|) in float64 (s: its scale now)."""
    live, s = life.live(), life.scales[life.active] * life.factors[life.active]
    out = {}
    for name in live:
        if name.endswith(".lora_A"):
            path = name.removesuffix(".lora_A")
            a, b = live[name].detach().double(), live[f"{path}.lora_B"].detach().double()
            out[path] = (s * b @ a, abs(s) * b.abs() @ a.abs())
    return out


def combine(life: Lifecycle, sources: list[str], weights: tuple[float, ...]) -> None:
    """``combine_adapters(sources, weights, "combined")`` (PEFT's ``add_weighted_adapter``, ``cat``): the new
    adapter's update is Σ wᵢ·sᵢ·Bᵢ·Aᵢ with the sources' scales *now* (factors included), its own scale 1; the
    sources and the active adapter bitwise unchanged, the active one still active.

    The update is judged per element in float64: |s_c·B_c·A_c − Σ wᵢ·sᵢ·Bᵢ·Aᵢ| ≤ 2·ε·Σ|wᵢ·sᵢ|·|Bᵢ|·|Aᵢ| + tiny, ε the
    adapters' machine epsilon: ``cat`` stores each source's A and wᵢ·sᵢ·Bᵢ, one rounding of each factor (relative
    ε/2 each, ε per product term), with a margin of 2. ε is the coarser of the adapters' dtype and the block's:
    PEFT 0.22 builds the new adapter in the base layer's dtype before the suite casts it to the sources' one."""
    impl, block, active = life.build.impl, life.probe.block, life.active
    if COMBINED in life.present:
        delete_adapter(life, COMBINED)
    before = {n: p.detach().clone() for n, p in life.live().items()}
    expected: dict[str, list[torch.Tensor]] = {}
    for name, w in zip(sources, weights):
        impl.set_active_adapter(block, name)
        life.active = name
        for path, (u, m) in _updates(life).items():
            acc = expected.setdefault(path, [torch.zeros_like(u), torch.zeros_like(m)])
            acc[0] += w * u
            acc[1] += abs(w) * m
    impl.set_active_adapter(block, active)
    life.active = active
    impl.combine_adapters(block, list(sources), list(weights), COMBINED)
    live = life.live()
    bad = [f"{n} changed" for n, t in before.items() if n not in live or not torch.equal(live[n].detach(), t)]
    if bad:
        raise LifecycleBroken(f"combine {sources} into {COMBINED!r}: the active adapter {active!r}: {describe(bad)}")
    life.present.append(COMBINED)
    life.factors[COMBINED], life.scales[COMBINED] = 1.0, 1.0
    impl.set_active_adapter(block, COMBINED)
    life.active = COMBINED
    try:
        eps = max(torch.finfo(next(iter(life.live().values())).dtype).eps, torch.finfo(life.dtype).eps)
        made = _updates(life)
    finally:
        impl.set_active_adapter(block, active)
        life.active = active
    for path, (want, size) in expected.items():
        if path not in made:
            bad.append(f"{path}: not adapted by {COMBINED!r}")
            continue
        err = (made[path][0] - want).abs()
        if (over := err > 2 * eps * size + 1e-12).any():
            i = int(over.flatten().nonzero()[0])
            bad.append(
                f"{path}: s·B·A element {i} is {float(made[path][0].flatten()[i]):.6g}, "
                f"Σ w·s·B·A gives {float(want.flatten()[i]):.6g} (scale of {COMBINED!r} taken as 1)"
            )
    bad += [f"{n} (a source or the base)" for n in life.base_changes()]
    if bad:
        raise LifecycleBroken(f"combine {sources} with weights {weights}: {describe(bad)}")
    life.frozen = life.snapshot()
