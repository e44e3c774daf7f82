"""The end-to-end training benchmark's logic on the CPU: run configs, not-applicable runs, figures and ratios."""

from __future__ import annotations

import pytest

from lora_suite.engine.step_record import StepRecord
from lora_suite.scenarios import training_bench as TB


def test_every_applicable_run_makes_a_valid_config():
    for case in TB.CASES:
        for mode in TB.MODES:
            if TB.not_applicable(case, mode):
                if mode == "captured":
                    with pytest.raises(ValueError, match="gradient_checkpointing"):  # the config refuses it too
                        TB.run_config(case, "peft", mode, warmup=10, measured=30)
                continue
            cfg = TB.run_config(case, "peft", mode, warmup=10, measured=30)
            assert cfg.weights == "random" and cfg.implementation == "peft" and cfg.train.steps == 40
            assert cfg.train.cuda_graph == (mode == "captured")
            assert cfg.data.pool == cfg.data.batch_size, "fixed windows: static shapes for the graph"
    with pytest.raises(ValueError, match="mode 'jit' is not one of"):
        TB.run_config(TB.CASES[0], "cupy", "jit", warmup=10, measured=30)


def test_compiled_runs_are_measured_for_cupy_only_and_not_with_checkpointing():
    from lora_suite.implementations import resolve_implementation

    small, seven_b = TB.CASES[0], next(c for c in TB.CASES if c.gradient_checkpointing)
    assert TB.not_applicable(small, "compiled", resolve_implementation("cupy")) is None
    assert "measured for cupy only" in TB.not_applicable(small, "compiled", resolve_implementation("peft"))
    assert "checkpointing" in TB.not_applicable(seven_b, "compiled", resolve_implementation("cupy"))
    assert TB.run_config(small, "cupy", "compiled", warmup=10, measured=30).train.cuda_graph is False


def test_captured_runs_are_applicable_unless_the_implementation_refuses_capture():
    seven_b = next(c for c in TB.CASES if c.gradient_checkpointing)
    assert TB.not_applicable(seven_b, "captured") is None  # checkpointing is captured with the step
    assert TB.run_config(seven_b, "cupy", "captured", warmup=3, measured=5).train.cuda_graph is True
    assert TB.not_applicable(seven_b, "eager") is None
    from lora_suite.implementations import resolve_implementation

    small = TB.CASES[0]
    assert TB.not_applicable(small, "captured", resolve_implementation("cupy")) is None
    assert TB.not_applicable(small, "captured", resolve_implementation("torch")) is None
    refusing = resolve_implementation("torch")
    refusing.not_applicable["cuda_graph_capture"] = "sets the cuBLAS stream on every call"
    assert TB.not_applicable(small, "captured", refusing) == "sets the cuBLAS stream on every call"
    assert TB.not_applicable(small, "captured", resolve_implementation("peft")) is None


def _records(step_s, gpu_s, n=12):
    return [StepRecord(i, 1.0, 1.0, 1e-4, 1.0, step_s, 0, 0, 0, None, gpu_s) for i in range(n)]


def test_figures_leave_the_warm_up_out_and_ratios_compare_with_peft():
    records = _records(0.5, 0.4, n=2) + _records(0.1, 0.08)
    fig = TB.figures(records, tokens_per_step=2048, warmup=2, peak_bytes=3 * 2**30)
    assert fig == TB.RunFigures(step_ms=pytest.approx(80.0), tokens_per_s=pytest.approx(20480.0), peak_gib=3.0)
    peft = {"eager": TB.RunFigures(400.0, 5120.0, 4.0), "captured": TB.RunFigures(100.0, 10240.0, 4.0)}
    assert TB.ratios(fig, peft) == {
        "speed_vs_peft_eager": pytest.approx(4.0),
        "speed_vs_peft_captured": pytest.approx(2.0),
        "peak_vs_peft_eager": 0.75,
        "peak_vs_peft_same_mode": 0.75,
    }
    assert TB.ratios(fig, peft, "captured")["peak_vs_peft_same_mode"] == 0.75
    peft["captured"] = TB.RunFigures(100.0, 10240.0, 6.0)
    assert TB.ratios(fig, peft, "captured")["peak_vs_peft_same_mode"] == 0.5
    assert TB.ratios(fig, {}) == {
        "speed_vs_peft_eager": None,
        "speed_vs_peft_captured": None,
        "peak_vs_peft_eager": None,
        "peak_vs_peft_same_mode": None,
    }
    with pytest.raises(ValueError, match="leave 1 measured steps"):
        TB.figures(records[:3], 2048, 2, 0)


def test_rotation_gives_each_implementation_each_position():
    names = ("peft", "torch", "cupy")
    orders = [TB.rotation(names, i) for i in range(3)]
    assert orders == [["peft", "torch", "cupy"], ["torch", "cupy", "peft"], ["cupy", "peft", "torch"]]
    assert {o[0] for o in orders} == set(names) and TB.rotation(names, 3) == orders[0]


def test_interleaved_speed_is_the_median_per_round_ratio_to_the_reference():
    # a host that slows down round by round slows every implementation alike: the ratio stays 2 and 0.5
    times = {"peft": [0.10, 0.20, 0.40, 0.30], "cupy": [0.05, 0.10, 0.20, 0.15], "torch": [0.2, 0.4, 0.8, 0.6]}
    est = TB.interleaved_speed(times, "peft")
    assert set(est) == {"cupy", "torch"}
    assert est["cupy"].median == pytest.approx(2.0) and est["cupy"].se == pytest.approx(0.0)
    assert est["torch"].median == pytest.approx(0.5)
    noisy = TB.interleaved_speed({"peft": [1.0, 1.0, 1.0], "cupy": [0.5, 1.0, 0.4]}, "peft")
    assert noisy["cupy"].median == pytest.approx(2.0) and noisy["cupy"].values == pytest.approx((2.0, 1.0, 2.5))
    assert noisy["cupy"].se > 0


@pytest.mark.parametrize(
    "times,match",
    [
        ({"cupy": [1.0, 1.0, 1.0]}, "reference 'peft' has no rounds"),
        ({"peft": [1.0, 1.0, 1.0], "cupy": [1.0, 1.0]}, "same number"),
        ({"peft": [1.0, 1.0], "cupy": [1.0, 1.0]}, r"same number \(>= 3\)"),
        ({"peft": [1.0, 1.0, 1.0], "cupy": [1.0, 0.0, 1.0]}, "positive seconds"),
    ],
)
def test_interleaved_speed_refuses_rounds_it_cannot_pair(times, match):
    with pytest.raises(ValueError, match=match):
        TB.interleaved_speed(times, "peft")


def _rec(step, captured, t):
    return StepRecord(
        step=step,
        loss=1.0,
        grad_norm=1.0,
        lr=1e-4,
        tokens_per_s=1.0,
        step_time_s=t,
        allocated_mib=0,
        reserved_mib=0,
        peak_allocated_mib=0,
        nvml_used_mib=None,
        captured=captured,
    )


def test_turn_step_times_keep_eager_steps_and_the_replays_after_the_capture():
    eager = [_rec(i, False, 0.1 * (i + 1)) for i in range(3)]
    assert TB.turn_step_times(eager, "eager") == pytest.approx([0.1, 0.2, 0.3])
    captured = [_rec(0, False, 1.0), _rec(1, False, 1.0), _rec(2, True, 5.0), _rec(3, True, 0.02), _rec(4, True, 0.03)]
    assert TB.turn_step_times(captured, "captured") == pytest.approx([0.02, 0.03])  # the capture step left out
    with pytest.raises(ValueError, match="need >= 2"):
        TB.turn_step_times(captured[:4], "captured")
    with pytest.raises(ValueError, match="an eager turn replayed 3 of 5"):
        TB.turn_step_times(captured, "eager")
    with pytest.raises(ValueError, match="'compiled' is not"):
        TB.turn_step_times(eager, "compiled")


def test_take_turns_drops_a_failing_peer_run_and_keeps_the_others_rounds_equal():
    order = []

    def turn(name, rnd):
        order.append((rnd, name))
        if name == "peer-eager" and rnd == 2:
            raise RuntimeError("bnb kernel refused capture")
        return {"peft-eager": 0.2, "cupy-eager": 0.1, "peer-eager": 0.3}[name]

    times, stopped = TB.take_turns(
        ["peft-eager", "cupy-eager", "peer-eager"], 4, turn, lambda name, exc: name.startswith("peer")
    )
    assert times == {"peft-eager": [0.2] * 4, "cupy-eager": [0.1] * 4}  # round 0 is the warm-up, not kept
    assert stopped == {"peer-eager": "round 2: RuntimeError: bnb kernel refused capture"}
    assert order[:3] == [(0, "peft-eager"), (0, "cupy-eager"), (0, "peer-eager")]
    assert order[3:6] == [(1, "cupy-eager"), (1, "peer-eager"), (1, "peft-eager")]  # rotated each round
    assert TB.interleaved_speed(times, "peft-eager")["cupy-eager"].median == 2.0


def test_take_turns_lets_the_suites_own_failure_and_a_cuda_error_through():
    def turn(name, rnd):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        TB.take_turns(["peft-eager", "peer-eager"], 3, turn, lambda name, exc: False)


def test_a_turn_run_trains_on_from_where_it_stopped_and_times_its_steps(tiny_cfg):
    from lora_suite.engine.prepare import prepare

    p = prepare(tiny_cfg, "cpu", implementation="torch")
    run = TB.TurnRun(p, tiny_cfg.train, "eager")
    first = run.turn(3)
    optimizer = run.optimizer
    second = run.turn(2)
    assert first > 0 and second > 0 and run.at == 5
    assert run.optimizer is optimizer, "the same optimizer carries its state from turn to turn"
