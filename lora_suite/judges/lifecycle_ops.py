"""The lifecycle's rules for the operations a user calls on an adapted model beyond training (``OPERATIONS`` of the
contract: merge again, unmerge, the adapters disabled for a block, the scale set by a factor, several adapters added,
switched and deleted), each a function of the ``lifecycle_state.Lifecycle`` it changes, raising ``LifecycleBroken``
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
    folded, life.merged = life.merged, None
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
    life.factors[name] = 1.0
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
    del life.factors[name]
    life.frozen = life.snapshot()
