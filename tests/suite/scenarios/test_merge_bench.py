"""The merge benchmark's parts (lora_suite.scenarios.merge_bench) on the CPU, with tiny shapes and the timer injected:
the rounds taken in turns after an untimed warm-up pass, each timed call on a fresh copy of the saved layer (which is
never merged), the guard that fails a merge or an unmerge that did nothing, and the rows' names and figures as
``compare`` pairs and judges them. The GPU benchmark itself: lora_suite/benchmarks/test_bench_merge.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lora_suite.implementations import LoRAImplementation, resolve_implementation
from lora_suite.implementations.lora_core_impl import LoraCoreImplementation
from lora_suite.results.compare import SPEED_KEY, _row_stats, compare_speed_ratios
from lora_suite.scenarios import merge_bench as MB

# the seven projections of MB.SHAPES, in its order, at (in, out) sizes the CPU merges in milliseconds
TINY = dict(zip(MB.SHAPES, [(24, 24), (24, 16), (24, 16), (24, 24), (24, 40), (24, 40), (40, 24)]))
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")


def _one_ms(fn) -> float:
    fn()
    return 1.0


def _measure(candidates, rounds=2, reps=1) -> MB.Measured:
    return MB.measure(candidates, _one_ms, device="cpu", shapes=TINY, rounds=rounds, reps=reps, tokens=5)


class _NoOpMerge(LoraCoreImplementation):
    """lora_core's torch layer whose merge does nothing: the adapters stay in the forward."""

    def merge_adapters(self, model):
        return None


def test_rounds_are_taken_in_turns_after_an_untimed_warm_up_pass():
    calls: list[str] = []
    ops = {
        (name, "merge"): MB.Op(lambda: None, lambda _m, name=name: calls.append(name), lambda _m: [])
        for name in ("a", "b", "c")
    }
    ticks = iter(range(1, 1000))

    def timer(fn):
        fn()
        return float(next(ticks))

    rounds = MB.take_rounds(ops, timer, rounds=3, reps=2)
    assert calls[:3] == ["a", "b", "c"]  # the warm-up pass: one call each, figures left out
    measured = calls[3:]
    turns = [measured[i : i + 2] for i in range(0, len(measured), 2)]
    assert all(t[0] == t[1] for t in turns) and len(turns) == 9  # each turn: one operation's reps in a row
    firsts = [turns[i][0] for i in (0, 3, 6)]
    assert sorted(firsts) == ["a", "b", "c"]  # each round's order rotated: no operation always first
    assert all(sorted(t[0] for t in turns[i : i + 3]) == ["a", "b", "c"] for i in (0, 3, 6))
    # a round's figure is the median of its reps (ticks 4.., two a turn): a's first turn took ticks 4 and 5
    assert rounds.times[("a", "merge")][0] == 4.5 and len(rounds.times[("a", "merge")]) == 3
    assert rounds.failures == {k: [] for k in ops}


def test_figures_carry_the_rounds_spread_and_the_same_round_ratio_to_the_reference():
    times = {("torch", "merge"): [2.0, 2.2, 2.4, 2.0, 2.1], ("peft", "merge"): [1.0, 1.0, 1.2, 0.9, 1.0]}
    ref = MB.figures(times, ("torch", "merge"))
    assert ref["cuda_median_ms"] == 2.1 and (ref["cuda_low_ms"], ref["cuda_high_ms"]) == (2.0, 2.4)
    assert not any("ratio" in k or SPEED_KEY in k for k in ref)  # the reference's own row: no ratio to itself
    fig = MB.figures(times, ("peft", "merge"))
    assert fig["rounds"] == 5 and fig["rounds_ms"] == times[("peft", "merge")]
    assert fig["cuda_p20_ms"] <= fig["cuda_median_ms"] == 1.0 <= fig["cuda_p80_ms"]
    assert fig["ratio_to_torch_merge"] == pytest.approx(1.0 / 2.1)  # per round, then the median
    assert fig["ratio_to_torch_merge_low"] == pytest.approx(0.45) and fig["ratio_to_torch_merge_high"] == 0.5
    assert fig["vs_torch_merge"] == "faster beyond the spread"  # its slowest round (1.2) beat torch's fastest (2.0)
    assert fig[MB.speed_key("peft", "merge")] == pytest.approx(2.1)
    # compare reads the CUDA-event median and the rounds' p20/p80 as the row's own spread
    med, spread = _row_stats({"extra_info": fig, "stats": {}})
    assert med == 1.0 and spread == pytest.approx((fig["cuda_p80_ms"] - fig["cuda_p20_ms"]) / 1.683)


def test_rows_are_named_so_that_compare_pairs_and_judges_them():
    assert MB.row_id("cupy") == "llama7b-layer-r16-cupy"
    assert MB.row_id("selected:peft-liger") == "llama7b-layer-r16-selected:peft-liger"
    key = MB.speed_key("peft", "unmerge")
    base, fell = {key: 3.0, f"{key}_se": 0.01}, {key: 2.0, f"{key}_se": 0.01}
    changes = compare_speed_ratios("test_unmerge[llama7b-layer-r16-peft]", base, fell)
    # device-clocked on both sides: a fall beyond the SE is a regression, never listed as a mixed-mode ratio
    assert [c.regression for c in changes] == [True] and not changes[0].note


def test_a_timed_call_runs_on_a_fresh_copy_and_the_saved_layer_is_never_merged():
    impl = resolve_implementation("torch")
    layer = MB.build_layer(TINY, device="cpu")
    adapters = MB.draw_adapters(layer, MB.R)
    pristine = MB.adapted_layer(impl, layer, adapters)
    before = {n: t.clone() for n, t in pristine.state_dict().items()}
    copy = MB.fresh(pristine)
    impl.merge_adapters(copy)
    assert isinstance(copy.get_submodule("mlp.down_proj"), torch.nn.Linear)  # lora_core's merge: a plain linear
    assert type(pristine.get_submodule("mlp.down_proj")).__name__ == "LoRALinear"
    assert all(torch.equal(before[n], t) for n, t in pristine.state_dict().items())
    held = impl.adapter_parameters(pristine)
    assert all(torch.equal(held[n], adapters[n]) for n in adapters)  # every implementation gets the same adapters


def test_measure_times_each_merge_and_unmerge_there_is_and_says_why_for_the_rest():
    candidates: dict[str, LoRAImplementation | str] = {
        "torch": resolve_implementation("torch"),
        "selected:cupy-fused": resolve_implementation("cupy-fused"),
        "gone": "gone is not installed",
    }
    if importlib.util.find_spec("peft") is not None:
        candidates["peft"] = resolve_implementation("peft")
    got = _measure(candidates)
    timed = {("torch", "merge")} | ({("peft", "merge"), ("peft", "unmerge")} if "peft" in candidates else set())
    assert set(got.rounds.times) == timed and all(len(v) == 2 for v in got.rounds.times.values())
    assert got.rounds.failures == {k: [] for k in timed}
    assert "no unmerge()" in got.not_applicable[("torch", "unmerge")]
    assert "fused MLP" in got.not_applicable[("selected:cupy-fused", "merge")]
    assert got.not_applicable[("gone", "unmerge")] == "no merge: gone is not installed"
    assert got.reach > 1.0  # the adapted and the base functions are told apart


def test_the_guard_fails_a_merge_that_did_nothing():
    got = _measure({"torch": resolve_implementation("torch"), "noop": _NoOpMerge("torch")}, rounds=2, reps=2)
    assert got.rounds.failures[("torch", "merge")] == []
    failures = got.rounds.failures[("noop", "merge")]
    assert len(failures) == 1 + 2 * 2  # every call, the warm-up's too
    assert failures[0].startswith("warm-up: not the adapted function: ") and "round 1: " in failures[-1]


@needs_peft
def test_the_guard_fails_an_unmerge_that_did_nothing():
    got = _measure({"peft": resolve_implementation("peft")})
    unmerge = got.ops[("peft", "unmerge")]
    idle = MB.Op(unmerge.prepare, lambda m: None, unmerge.guard)  # the layers stay merged
    rounds = MB.take_rounds({("peft", "unmerge"): idle}, _one_ms, rounds=2, reps=1)
    failures = rounds.failures[("peft", "unmerge")]
    assert len(failures) == 3 and all("not the base function" in f for f in failures)
