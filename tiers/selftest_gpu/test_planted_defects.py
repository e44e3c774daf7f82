"""selftest-gpu: the suite proves its own sensitivity. Each test plants one defect (a monkeypatch here,
never in shipped code) and asserts that the tier criterion written for that class of bug fails on it.

A test here passes when the criterion FAILS on the planted defect; each records that as a check
("planted ... caught"), with the criterion's value, so the report shows by how much it was caught.
The same criteria pass on the unplanted code in the tiers' own runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from pathlib import Path

import pytest
import torch

from lora_suite import gradients as G
from lora_suite import trainer
from lora_suite.benchmarking import NOISE_Z
from lora_core.ops import lora_linear as op
from lora_suite.trainer import NonFiniteError

pytestmark = [pytest.mark.gpu, pytest.mark.selftest_gpu]
ROOT = Path(__file__).resolve().parents[2]


def _load(relpath: str, name: str):
    """A tier's or benchmark's module by path (test modules are not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ whole-model gradients (quick tier)
def _gradient_results(tier):
    cfg = tier.config("quick")
    prepared = tier.prepare(cfg)
    G.randomize_lora_b(prepared.model, std=0.02, seed=cfg.train.seed, adapters=prepared.adapters)
    reference = tier.prepare(cfg, implementation="torch")
    G.copy_adapters(reference.adapters, {n: p.detach() for n, p in prepared.adapters.items()})
    return G.whole_model_checks(prepared.model, prepared.batches(0), label=tier.impl.name, adapters=prepared.adapters,
                                reference=reference.model, reference_adapters=reference.adapters,
                                k=cfg.criteria.grad_accum_k, factor=cfg.criteria.grad_match_factor)


def _caught(tier, what: str, result: G.WholeModelResult):
    tier.check(f"planted {what}: adapters beyond tolerance in '{result.label}'", result.n_bad, ">", 0,
               source="quick tier's whole-model gradient check", detail=G.describe_failures(result.rows, 2))


@pytest.mark.needs_feature("lora_core_ops")
def test_stale_activation_shared_between_layers_is_caught(tier, monkeypatch):
    """Every cupy LoRA layer of one input shape saves the first such layer's input for its backward."""
    real = op.CupyLoRALinear.forward
    stale: dict = {}

    def forward(ctx, x, weight, lora_a, lora_b, scale):
        y = real(ctx, x, weight, lora_a, lora_b, scale)
        saved = list(ctx.to_save)
        saved[0] = stale.setdefault(tuple(saved[0].shape), saved[0])
        ctx.save_for_backward(*saved)
        return y

    monkeypatch.setattr(op.CupyLoRALinear, "forward", staticmethod(forward))
    _caught(tier, "stale saved activation", _gradient_results(tier)[0])


@pytest.mark.needs_feature("lora_core_ops")
def test_dA_without_its_scale_is_caught(tier, monkeypatch):
    """The cupy backward returns dA without the LoRA scale s (alpha / r = 2 in the quick tier)."""
    real = op.CupyLoRALinear.backward

    def backward(ctx, dy):
        dx, dw, da, db, ds = real(ctx, dy)
        return dx, dw, None if da is None else da / ctx.scale, db, ds

    monkeypatch.setattr(op.CupyLoRALinear, "backward", staticmethod(backward))
    _caught(tier, "dA missing the scale", _gradient_results(tier)[0])


def test_accumulation_without_division_is_caught(tier, monkeypatch):
    def summed(model, micro_batches):
        total = 0.0
        for b in micro_batches:
            loss = model(input_ids=b["input_ids"], labels=b["labels"]).loss
            loss.backward()
            total = total + loss.detach()
        return total

    monkeypatch.setattr(trainer, "accumulate_gradients", summed)
    accumulation = [r for r in _gradient_results(tier) if "accumulation" in r.label]
    _caught(tier, "accumulation without 1/k", accumulation[0])


# ------------------------------------------------------------------ convergence tier: captured vs eager
def test_a_captured_step_that_keeps_the_capture_time_lr_is_caught(tier, monkeypatch):
    """The classic capture bug: a host-side value that is not fed into the graph. Here the learning rate is never
    written into the capturable optimizer's lr tensor, so every step runs at the configured peak instead of the
    warm-up and cosine schedule. The convergence tier's captured-vs-eager band must catch it (40 steps here)."""
    from lora_suite.criteria import loss_match
    conv = _load("tiers/convergence/test_convergence_tier.py", "convergence_tier")
    cfg = tier.config("convergence")
    if not cfg.train.cuda_graph:
        pytest.skip("the convergence tier does not capture its steps for this implementation")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=40))
    eager_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, cuda_graph=False))
    crit = cfg.criteria
    first = tier.prepare(cfg)
    init = {n: p.detach().clone() for n, p in first.adapters.items()}
    del first
    ref = conv._run(tier, cfg, "torch", init)
    control = conv._run(tier, cfg, "torch", init, perturb=crit.control_perturbation)
    eager = conv._run(tier, eager_cfg, None, init)
    real = trainer.set_lr

    def set_lr_but_not_into_tensors(optimizer, lr):
        if not any(torch.is_tensor(g["lr"]) for g in optimizer.param_groups):
            real(optimizer, lr)

    monkeypatch.setattr(trainer, "set_lr", set_lr_but_not_into_tensors)
    planted = conv._run(tier, cfg, None, init)
    _, beyond = loss_match(planted.losses, eager.losses, control.losses, crit.loss_match_factor, crit.loss_match_floor)
    _, beyond_ref = loss_match(ref.losses, eager.losses, control.losses, crit.loss_match_factor, crit.loss_match_floor)
    tier.check("planted lr never written into the captured step: steps beyond the captured-vs-eager band",
               len(beyond), ">", 0, source="convergence tier's captured-vs-eager check", detail=f"first: {beyond[:5]}")
    tier.report.notes.append(f"{tier.nodeid}: unplanted torch-reference captured run vs eager: {len(beyond_ref)} steps "
                             "beyond the same band (a different implementation, for scale)")


# ------------------------------------------------------------------ extended tier: leak and slow paths
def _extended_records(tier, hook, steps: int, forward_work=None):
    """Train the extended configuration for ``steps``; ``hook(step)`` after each optimizer step and, if given,
    ``forward_work(step)`` before every forward (inside the forward+backward the device time measures)."""
    cfg = tier.config("extended")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
    prepared = tier.prepare(cfg)
    state = {"step": 0}
    if forward_work is not None:
        prepared.model.register_forward_pre_hook(lambda module, args, kwargs: forward_work(state["step"]),
                                                 with_kwargs=True)

    def step_hook(step):
        state["step"] = step + 1
        hook(step)
    return cfg, tier.train(f"extended, planted ({hook.__name__})", prepared, cfg, step_hook=step_hook).records


def _extended_run(tier, hook, steps: int = 150, forward_work=None):
    """The extended tier's configuration (fit after 50, windows of 50), with planted hooks."""
    ext = _load("tiers/extended/test_extended_tier.py", "extended_tier")
    cfg, records = _extended_records(tier, hook, steps, forward_work)
    verdicts, _ = ext.extended_verdicts(cfg, records)
    return {v.name.split(" after")[0].split(" slope")[0].split(",")[0]: v for v in verdicts}


_MEDIANS: dict[str, float] = {}


def _median_ms(tier, which: str) -> float:
    """Median step time (``"step"``: CUDA-event span; ``"cpu"``: process CPU time) of the extended configuration
    without a defect (60 steps, the first 20 left out)."""
    if not _MEDIANS:
        def no_defect(step):
            return None
        _, records = _extended_records(tier, no_defect, 60)
        steps = sorted(r.gpu_time_s for r in records[20:])
        _MEDIANS["step"] = steps[len(steps) // 2] * 1e3
        cpu = sorted(r.cpu_time_s for r in records[20:])
        _MEDIANS["cpu"] = cpu[len(cpu) // 2] * 1e3
    return _MEDIANS[which]


def _assert_fails(tier, what: str, v):
    tier.check(f"planted {what}: '{v.name}' fails ({v.value} {v.op} {v.threshold} is false)", v.passed, "==", False,
               source="extended tier criterion", detail=v.detail)


def test_a_leak_is_caught(tier):
    kept = []

    def leak(step):  # one (512, 2048) bf16 activation kept per step: 2 MiB/step
        kept.append(torch.empty(512, 2048, dtype=torch.bfloat16, device="cuda"))

    verdicts = _extended_run(tier, leak)
    _assert_fails(tier, "leak of 2 MiB/step", verdicts["allocated_mib"])


def _gpu_work(ms: float):
    """work(scale): extra GPU work of about scale × ``ms`` milliseconds (bf16 4096² matmuls into one buffer,
    timed once here); returns None (it also serves as a forward pre-hook)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        torch.matmul(a, a, out=out)
    end.record()
    torch.cuda.synchronize()
    per = start.elapsed_time(end) / 10

    def work(scale: float) -> None:
        for _ in range(max(0, round(ms * scale / per))):
            torch.matmul(a, a, out=out)
    return work


def _host_work(ms: float):
    """work(scale): extra host work of about scale × ``ms`` milliseconds of process CPU time: walks over a
    Python list (timed once here), as a per-call history that keeps growing would cost; returns None."""
    history = list(range(100_000))
    t0 = time.process_time()
    for _ in range(20):
        sum(history)
    per = (time.process_time() - t0) / 20 * 1e3

    def work(scale: float) -> None:
        for _ in range(max(0, round(ms * scale / per))):
            sum(history)
    return work


def test_a_progressive_slowdown_is_caught(tier):
    """A 300-step extended run (windows 50-99 and 250-299), each forward doing extra host work that grows with
    the step (a history that every step walks again): +0% at step 0, +40% of the median step's CPU time by the
    last. Host work, not GPU work: the extended tier judges tokens per process CPU-second, and its TinyLlama
    step is host-bound, so a plant of extra GPU work only filled the GPU's idle gaps and did not slow the step
    (reports/20261122T081042Z-selftest-gpu: windows 7% apart); a slowdown of the host path is what the
    criterion exists to see (per-call host-side overhead that grows)."""
    work = _host_work(_median_ms(tier, "cpu"))
    steps = 300

    def no_hook(step):
        return None

    verdicts = _extended_run(tier, no_hook, steps=steps, forward_work=lambda step: work(0.40 * step / steps))
    _assert_fails(tier, "progressive slowdown to +40%", verdicts["tokens per process CPU-second drift"])


def test_stalls_on_a_quarter_of_the_steps_are_caught(tier):
    """Every 4th step stalls for twice a median step (e.g. a synchronising allocator retry every 4 steps)."""
    work = _gpu_work(_median_ms(tier, "step"))

    def every_fourth(step):
        work(2.0 if step % 4 == 0 else 0.0)

    verdicts = _extended_run(tier, every_fourth)
    _assert_fails(tier, "3x stall every 4th step", verdicts["share of steps slower than 2.5 x the median step (stalls)"])


# ------------------------------------------------------------------ non-finite guard
def test_a_nan_adapter_stops_training_and_keeps_the_records(tier):
    cfg = tier.config("quick")
    prepared = tier.prepare(cfg)
    name = next(iter(prepared.adapters))

    def poison(step):
        if step == 4:
            with torch.no_grad():
                prepared.adapters[name].fill_(float("nan"))

    with pytest.raises(NonFiniteError) as info:
        tier.train("quick, planted NaN", prepared, cfg, step_hook=poison)
    tier.check("planted NaN adapter: error names the adapter", name in str(info.value), "==", True,
               detail=str(info.value)[:300])
    kept = [s for s in tier.report.series if s.name == "quick, planted NaN: loss"]
    tier.check("planted NaN adapter: step records kept up to the stop", len(kept[0].rows) if kept else 0, "==", 5)


# ------------------------------------------------------------------ benchmark bars
@pytest.mark.needs_feature("lora_core_ops")
def test_a_slowed_dequantisation_fails_the_bandwidth_bar(tier):
    nf4_bench = _load("benchmarks/test_bench_nf4.py", "bench_nf4")

    def twice(q, out=None):  # the kernel's work done twice: a 2x slower dequantisation
        nf4_bench.dequantize_nf4(q, out=out)
        return nf4_bench.dequantize_nf4(q, out=out)

    attempts, _ = nf4_bench.dequant_bar_attempts((11008, 4096), dequant=twice)
    best = max(a.estimate.median + NOISE_Z * a.estimate.se for a in attempts)
    tier.check(f"planted 2x slower dequant: bar fails on all {len(attempts)} attempts (best fraction + z SE)",
               round(best, 3), "<", nf4_bench.MIN_FRACTION_OF_COPY, source="benchmarks/test_bench_nf4.py bar")


@pytest.mark.needs_feature("lora_core_ops")
def test_a_slowed_cupy_path_fails_the_peft_bar(tier, monkeypatch):
    pytest.importorskip("peft", reason="peft is not installed: the cupy-vs-PEFT bar needs it")
    bench = _load("benchmarks/test_bench_lora_linear.py", "bench_lora")
    real = op.CupyLoRALinear.backward

    def backward(ctx, dy):  # the backward's GEMMs run twice (a planted redundant pass)
        real(ctx, dy)
        return real(ctx, dy)

    monkeypatch.setattr(op.CupyLoRALinear, "backward", staticmethod(backward))
    attempts = bench.cupy_vs_peft_attempts("llama7b-8192tok-4096to4096-r16")
    best = min(a.estimate.median - NOISE_Z * a.estimate.se for a in attempts)
    tier.check(f"planted doubled cupy backward: cupy - PEFT ratio stays > 0 on all {len(attempts)} attempts",
               round(best, 4), ">", 0.0, source="benchmarks/test_bench_lora_linear.py bar")
