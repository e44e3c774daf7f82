"""The fused table (lora_suite.scenarios.fused_table) on the CPU: an isolated stack's child process (its timed run or
its kernel profile) is read back or its failure named; the rounds are taken in turns with no stack always first;
and the summary's rows carry each stack's spread over the rounds and say whether a ratio is beyond it. The kernel
profiles themselves: tests/suite/scenarios/test_step_profile.py."""

from __future__ import annotations

import pytest

from lora_suite.scenarios import fused_cells as FC
from lora_suite.scenarios import fused_child as CH
from lora_suite.scenarios import fused_table as FT
from lora_suite.scenarios import step_profile as SP


def test_an_isolated_stacks_child_output_is_read_or_its_failure_named():
    import dataclasses
    import json

    fig = FT.EagerFigures(1.0, 2.0, 3.5, 4.25, "unsloth", "none", 10.5, 0.25)
    out = "Unsloth: patching\n" + CH.CHILD_MARK + json.dumps(dataclasses.asdict(fig)) + "\n"
    assert CH.parse_child_output(0, out, "", "unsloth") == fig
    with pytest.raises(RuntimeError, match="exited 1 without figures: .*CUDA out of memory"):
        CH.parse_child_output(1, "", "Traceback\ntorch.OutOfMemoryError: CUDA out of memory", "unsloth")
    with pytest.raises(RuntimeError, match="exited 0 without figures"):
        CH.parse_child_output(0, "no mark here", "", "unsloth")
    assert FT.ISOLATED <= set(FT.STACKS)


def _profile(span_ms=80.0):
    from lora_suite.engine.benchmarking import KernelTime, OpTime

    kernels = [KernelTime("_fg_kernel", 22.0, 9.5), KernelTime("nvjet_sm90_tst_128x128", 310.0, 41.0)]
    ops = [OpTime("aten::mm", 300.0, 40.0), OpTime("LoRA_MLP", 22.0, 9.5)]
    kinds = {"Unsloth (Triton)": 9.5, "GEMM (cuBLAS)": 41.0}
    return SP.StepProfile(50.5, kinds, kernels, ops, span_ms, 96.25)


def test_an_isolated_stacks_profile_is_read_back_from_its_childs_last_marked_line():
    import json

    old, new = _profile(span_ms=70.0), _profile()
    out = (
        "Unsloth: Will patch your computer to enable 2x faster free finetuning.\n"
        + CH.CHILD_MARK
        + json.dumps(SP.profile_to_json(old))
        + "\n"
        + CH.CHILD_MARK
        + json.dumps(SP.profile_to_json(new))
        + "\n"
    )
    got = CH.parse_child_output(0, out, "", "unsloth", SP.profile_from_json)
    assert got == new and got.span_ms == 80.0
    assert got.kernels[0].name == "_fg_kernel" and got.ops[0].calls == 300.0
    with pytest.raises(RuntimeError, match=r"unsloth: the child process exited 1 without figures: .*Triton"):
        CH.parse_child_output(1, out, "Traceback\ntriton.runtime.errors.OutOfResources: Triton", "unsloth")
    # a child killed after it printed a profile is still a failure: the figures may be of a step that did not end
    with pytest.raises(RuntimeError, match="exited -9 without figures"):
        CH.parse_child_output(-9, out, "", "unsloth", SP.profile_from_json)


def test_the_profile_child_is_asked_for_a_profile_of_its_case_and_read_as_one(monkeypatch):
    """``profile_in_child`` and ``eager_in_child`` go through the one child: its arguments name the mode, the case,
    the stack and the base's quantisation, and what it prints is read as the mode's figures."""
    import dataclasses
    import json
    import subprocess

    seen = []

    def run(cmd, **kwargs):
        args = json.loads(cmd[-1])
        seen.append(args)
        data = SP.profile_to_json(_profile()) if args["mode"] == "profile" else dataclasses.asdict(_figs([9.0])[0])
        return subprocess.CompletedProcess(cmd, 0, "noise\n" + CH.CHILD_MARK + json.dumps(data) + "\n", "")

    monkeypatch.setattr(subprocess, "run", run)
    case = FT.EAGER_CASES[3]
    assert CH.profile_in_child(case, "unsloth", warmup=3, measured=10, quantize="nf4", steps=4) == _profile()
    assert CH.eager_in_child(case, "unsloth", warmup=3, measured=10) == _figs([9.0])[0]
    assert [a["mode"] for a in seen] == ["profile", "eager"]
    assert seen[0]["quantize"] == "nf4" and seen[0]["steps"] == 4 and seen[0]["stack"] == "unsloth"
    assert FT.Case(**{k: tuple(v) if isinstance(v, list) else v for k, v in seen[0]["case"].items()}) == case


def test_a_child_asked_for_an_unknown_mode_names_it():
    import json

    args = {"case": {}, "stack": "unsloth", "mode": "trace", "warmup": 1, "measured": 1}
    with pytest.raises(ValueError, match=r"mode is one of \('eager', 'profile'\), got 'trace'"):
        CH.child_main(json.dumps(args))


@pytest.mark.parametrize(("rounds", "stacks"), [(1, 8), (2, 4), (3, 8), (3, 2), (5, 6)])
def test_the_schedule_runs_every_stack_once_a_round_in_turns_with_a_different_first(rounds, stacks):
    names = [f"s{i}" for i in range(stacks)]
    cases = FT.EAGER_CASES[:2]
    runs = FT.schedule(cases, names, rounds=rounds)
    assert len(runs) == len(cases) * rounds * stacks
    for ci, case in enumerate(cases):
        mine = runs[ci * rounds * stacks : (ci + 1) * rounds * stacks]
        assert all(c is case for c, _, _ in mine)
        per_round = [[s for _, r, s in mine if r == rnd] for rnd in range(rounds)]
        assert [r for _, r, _ in mine] == sorted(r for _, r, _ in mine)  # round r after round r - 1
        assert all(sorted(order) == sorted(names) for order in per_round)
        firsts = [order[0] for order in per_round]
        assert len(set(firsts)) == min(rounds, stacks)  # no two rounds start with the same stack


def test_three_eager_rounds_put_no_stack_always_first_nor_always_last():
    runs = FT.schedule(FT.EAGER_CASES[:1], FT.STACKS, rounds=3)
    orders = [[s for _, r, s in runs if r == rnd] for rnd in range(3)]
    for stack in FT.STACKS:
        places = [order.index(stack) for order in orders]
        assert len(set(places)) == 3, (stack, places)


@pytest.mark.parametrize(("value", "rounds"), [(None, FT.EAGER_ROUNDS), ("", FT.EAGER_ROUNDS), ("5", 5), (" 1 ", 1)])
def test_the_eager_rounds_default_to_three_or_follow_the_environment(value, rounds):
    env = {} if value is None else {FT.ROUNDS_ENV: value}
    assert FT.eager_rounds(env) == rounds
    assert FT.EAGER_ROUNDS >= 3


@pytest.mark.parametrize("value", ["0", "-2", "three", "2.5"])
def test_eager_rounds_that_are_not_an_integer_of_at_least_one_are_refused_by_value(value):
    with pytest.raises(ValueError, match=f"LORA_SUITE_FUSED_ROUNDS must be an integer >= 1.*{value!r}"):
        FT.eager_rounds({FT.ROUNDS_ENV: value})


def _figs(steps, peaks=None, fwd=None):
    peaks = peaks or [10.0] * len(steps)
    fwd = fwd or [s / 2 for s in steps]
    return [FT.EagerFigures(f, s - f, s, p, "x", "none", 10.5, 0.25) for s, p, f in zip(steps, peaks, fwd)]


def test_a_medians_row_carries_the_step_spread_and_the_rounds():
    figs = _figs([180.0, 120.0, 150.0], peaks=[20.0, 20.5, 20.25])
    cells = FC.median_cells(figs, ("fwd_ms", "step_ms", "peak_gib"))
    assert cells == (75.0, 150.0, 20.25, 120.0, 180.0, 3)
    assert FC.MEDIAN_SPREAD_COLUMNS == ("step ms min", "step ms max", "rounds")


def test_a_comparison_row_says_whether_its_ratio_is_beyond_the_spread():
    base, fused = _figs([200.0, 210.0, 190.0], peaks=[21.0] * 3), _figs([150.0, 160.0, 155.0], peaks=[18.9] * 3)
    speed, peak, low, high, verdict = FC.comparison_cells(base, fused)
    assert (speed, peak, low, high, verdict) == (1.29, 0.9, 1.188, 1.4, "faster beyond the spread")
    overlapping = _figs([150.0, 210.0, 200.0])
    assert FC.comparison_cells(overlapping, fused)[-1] == "within the spread"
    assert FC.comparison_cells(base[:1], fused)[-1] == "one round: not judged"
    assert FC.comparison_cells([], fused) == (None, None, None, None, None)
    # a part other than the step: the forward's rounds (base's fwd 100..105 against fused's 110..120)
    base_fwd, fused_fwd = _figs([200.0] * 3, fwd=[100.0, 105.0, 102.0]), _figs([150.0] * 3, fwd=[110.0, 120.0, 115.0])
    assert FC.comparison_cells(base_fwd, fused_fwd, "fwd_ms")[-1] == "slower beyond the spread"


def test_the_unsloth_target_row_needs_the_slowest_fused_round_at_1_2x_the_fastest_unsloth_round():
    unsloth = _figs([240.0, 250.0, 260.0], peaks=[21.0] * 3)
    assert FC.target_cells(unsloth, _figs([190.0, 195.0, 200.0], peaks=[18.8] * 3))[-1] == "met"
    near = FC.target_cells(unsloth, _figs([190.0, 200.0, 220.0], peaks=[18.8] * 3))
    assert near[0] == 1.25 and near[-1].startswith("not met") and near[-2] == "faster beyond the spread"
    heavier = FC.target_cells(unsloth, _figs([190.0, 195.0, 200.0], peaks=[21.5] * 3))
    assert heavier[-1].startswith("not met: peak up to 21.500 GiB")
    assert len(FC.TARGET_COLUMNS) == len(near) and FC.TARGET_COLUMNS[-1].startswith("1.2x target")


def test_a_stack_that_cannot_run_here_says_why(monkeypatch):
    """``unavailable``: the implementation's own error when it cannot be resolved, Liger-Kernel named when a +liger
    stack lacks it, None when both are there."""
    import importlib.util

    from lora_suite import implementations
    from lora_suite.implementations import ImplementationError

    def resolve(name):
        if name == "unsloth":
            raise ImplementationError("unsloth is not installed: pip install unsloth")
        return object()

    monkeypatch.setattr(implementations, "resolve_implementation", resolve)
    assert FT.unavailable("unsloth") == "unsloth is not installed: pip install unsloth"
    assert FT.unavailable("cupy") is None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "liger_kernel" else real(n, *a))
    assert "liger_kernel not installed" in FT.unavailable("cupy-fused+liger")
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "liger_kernel" else real(n, *a))
    assert FT.unavailable("cupy-fused+liger") is None


def test_liger_stacks_apply_to_the_families_liger_covers_only(monkeypatch):
    """The Qwen2- and Gemma-shaped cases run every stack (Liger covers Llama, Qwen2 and Gemma 2: liger_ops.FAMILIES);
    a model of another family is not applicable to a stack with Liger's ops, with its reason; the cases' models are
    the families their names say."""
    import importlib.util

    from lora_suite import implementations

    monkeypatch.setattr(implementations, "resolve_implementation", lambda name: object())
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "liger_kernel" else real(n, *a))
    cases = {FT.model_family(c): c for c in FT.EAGER_CASES}
    assert {"llama", "qwen2", "gemma2"} <= set(cases)
    assert all(FT.unavailable(s, case) is None for s in FT.STACKS for case in cases.values())
    monkeypatch.setattr(FT, "model_family", lambda case: "mixtral")
    for stack in FT.STACKS:
        reason = FT.unavailable(stack, cases["llama"])
        if "liger" in stack:
            assert reason is not None and "is mixtral" in reason and "('llama', 'qwen2', 'gemma2')" in reason
        else:
            assert reason is None, (stack, reason)
