"""multigpu tier (issue 11): LoRA training with DistributedDataParallel on N GPUs of one host, via torchrun.

Three jobs from the same seed (lora_suite/scenarios/multigpu.py launches each under torchrun, with a timeout):
  multi     N ranks, the global batch B split by rows, DDP averaging the adapters' gradients
  single    one process with the whole batch B: the reference
  control   ``single`` with lora_A perturbed elementwise by ±2^-8 (bf16 unit roundoff)
  planted   ``multi`` without DDP (gradients never averaged): the rank-agreement check must see it
Checks: every rank's adapters bitwise identical to rank 0's after training; the base weights bitwise untouched
on every rank; every rank served by the implementation's path; the trained adapters of ``multi`` within the
same band of ``single``'s per tensor (``adapter_gaps``); per-step losses of ``multi`` within
max(factor·e(t), floor) of ``single`` (e(t): the control's running gap; the convergence tier's band and its
derivation: the split changes GEMM shapes and so rounding, nothing else); the loss falls; scaling efficiency
(tokens/s on N GPUs ÷ (N × one GPU), a figure until calibrated). A planted failure (rank 1 raises at step 3)
must end the whole job within ``rank_failure_seconds_max`` with that rank's error in the report.
"""

from __future__ import annotations

import pytest
import torch

from lora_suite.harness.loss_band import LossBand, judge_loss_band
from lora_suite.measure.criteria import loss_drop
from lora_suite.scenarios.multigpu import adapter_gaps, failure_summary, launch, scaling_efficiency
from lora_suite.settings.config import CONFIG_DIR

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
CONFIG = CONFIG_DIR / "multigpu.yaml"
JOB_TIMEOUT_S = 300


def gpus_for_run(request) -> int:
    """--gpus N, or every visible GPU; a skip with the count found when fewer than two."""
    visible = torch.cuda.device_count()
    n = request.config.getoption("gpus") or visible
    if n < 2 or visible < 2:
        pytest.skip(
            f"the multigpu tier needs at least 2 GPUs; found {visible} visible"
            + (f" (--gpus {n})" if request.config.getoption("gpus") else "")
        )
    if n > visible:
        pytest.fail(f"--gpus {n}, but only {visible} GPUs are visible")
    return n


def _job_failed(tier, what: str, res) -> None:
    tail = "\n".join(res.stderr.splitlines()[-15:])
    pytest.fail(
        f"{what} job ({res.nproc} processes) {'timed out' if res.timed_out else f'exited {res.returncode}'} "
        f"after {res.seconds:.0f} s: {failure_summary(res) or 'no rank error line'}\n{tail}"
    )


def _run_job(tier, name: str, config, out, nproc: int, **options):
    """One job of ``nproc`` ranks (``launch``, within JOB_TIMEOUT_S), noted in the report; the test fails, with the
    job's errors, unless it exited 0 with every rank's record."""
    res = launch(config, out, nproc, timeout_s=JOB_TIMEOUT_S, **options)
    tier.report.notes.append(f"{tier.nodeid}: {name} job, {nproc} GPU(s): exit {res.returncode}, {res.seconds:.1f} s")
    if res.returncode != 0 or len(res.ranks) != nproc:
        _job_failed(tier, name, res)
    return res


def test_ddp_matches_one_gpu_and_ranks_agree(tier, request, tmp_path):
    n = gpus_for_run(request)
    cfg = tier.config("multigpu")
    crit = cfg.criteria
    impl = tier.impl.name
    runs = {}
    for name, nproc, perturb, plant in (
        ("multi", n, 0.0, False),
        ("single", 1, 0.0, False),
        ("control", 1, crit.control_perturbation, False),
        ("planted", n, 0.0, True),
    ):
        runs[name] = _run_job(
            tier, name, CONFIG, tmp_path / name, nproc, implementation=impl, perturb=perturb, plant_no_sync=plant
        )
    ranks = runs["multi"].ranks
    single = runs["single"].ranks[0]
    tier.check(
        f"ranks whose adapters differ bitwise from rank 0's after {cfg.train.steps} steps",
        sum(bool(r["adapters_differing_from_rank0"]) for r in ranks),
        "==",
        0,
        detail="; ".join(
            f"rank {r['rank']}: {r['adapters_differing_from_rank0'][:3]}"
            for r in ranks
            if r["adapters_differing_from_rank0"]
        ),
    )
    tier.check(
        "the rank check's control: ranks whose adapters differ from rank 0's when the gradients are never "
        "averaged (planted: no DDP)",
        sum(bool(r["adapters_differing_from_rank0"]) for r in runs["planted"].ranks),
        ">=",
        1,
        source="the check must fail on the defect it exists for",
    )
    tier.check("ranks whose frozen base weights changed", sum(not r["base_untouched"] for r in ranks), "==", 0)
    tier.check(
        f"ranks not served by the implementation's path ({tier.impl.expected_path})",
        sum(r["served_by"] != tier.impl.expected_path for r in ranks),
        "==",
        0,
        detail=str(sorted({r["served_by"] for r in ranks})),
    )
    band = LossBand(
        f"per-step loss: {n} GPUs (DDP) vs one GPU, global batch {cfg.data.batch_size}",
        "one GPU",
        f"{n} GPUs",
        f"steps where the {n}-GPU loss leaves the band around the one-GPU loss",
        "max(loss_match_factor*e(t), loss_match_floor): configs/multigpu.yaml",
    )
    control = runs["control"].ranks[0]["losses"]
    judge_loss_band(
        tier, band, ranks[0]["losses"], single["losses"], control, crit.loss_match_factor, crit.loss_match_floor
    )
    from safetensors.torch import load_file

    saved = {name: load_file(str(tmp_path / name / "adapters.safetensors")) for name in ("multi", "single", "control")}
    gap_rows, gap_beyond = adapter_gaps(
        saved["multi"], saved["single"], saved["control"], crit.loss_match_factor, crit.loss_match_floor
    )
    worst = max(gap_rows, key=lambda r: r[1] / r[3])
    tier.check(
        f"adapter tensors of the {n}-GPU run beyond the band around the one-GPU run's after {cfg.train.steps} "
        f"steps (of {len(gap_rows)}; worst {worst[0]}: {worst[1]:.3g} vs {worst[3]:.3g})",
        len(gap_beyond),
        "==",
        0,
        source="max(loss_match_factor*d(control), loss_match_floor) per tensor: configs/multigpu.yaml",
        detail=", ".join(gap_beyond[:5]),
    )
    drop = loss_drop(ranks[0]["losses"], crit.loss_window)
    tier.check(
        f"{n}-GPU loss drop, mean of first {crit.loss_window} vs last {crit.loss_window} steps",
        round(drop, 4),
        ">=",
        crit.loss_drop_min,
        source="configs/multigpu.yaml loss_drop_min",
    )
    tokens_n = sum(r["local_tokens_per_s"] for r in ranks)
    eff = scaling_efficiency(tokens_n, n, single["local_tokens_per_s"])
    tier.report.add_row(
        tier.nodeid,
        "multi-GPU throughput (median tokens/s after warm-up)",
        ("GPUs", "tokens/s", "one GPU tokens/s", "scaling efficiency", "peak GiB per rank"),
        (
            n,
            round(tokens_n),
            round(single["local_tokens_per_s"]),
            round(eff, 3),
            max(r["peak_allocated_gib"] or 0 for r in ranks),
        ),
    )
    if crit.scaling_efficiency_min is None:
        tier.check.not_applicable(
            "scaling efficiency floor",
            f"no floor calibrated yet (measured {eff:.3f}; configs/multigpu.yaml scaling_efficiency_min)",
        )
    else:
        tier.check(
            "scaling efficiency, tokens/s on N GPUs / (N x one GPU)",
            round(eff, 3),
            ">=",
            crit.scaling_efficiency_min,
            source="configs/multigpu.yaml scaling_efficiency_min; noise model: the N-GPU "
            "and 1-GPU jobs run one after the other, so the host's speed between them is not cancelled; the "
            "floor sits below the calibration runs named in the YAML to absorb it (not yet paired: issue 18)",
        )


def test_a_failing_rank_ends_the_whole_job(tier, request, tmp_path):
    n = gpus_for_run(request)
    cfg = tier.config("multigpu")
    limit = cfg.criteria.rank_failure_seconds_max
    res = launch(
        CONFIG,
        tmp_path / "fail",
        n,
        timeout_s=limit + 60,
        mode="fail",
        fail_rank=1,
        fail_at=3,
        implementation=tier.impl.name,
    )
    summary = failure_summary(res) or ""
    tier.report.notes.append(
        f"{tier.nodeid}: planted failure on rank 1: exit {res.returncode} after "
        f"{res.seconds:.1f} s; first rank error: {summary}"
    )
    tier.check("the job with a failing rank ended (not killed at the timeout)", res.timed_out, "==", False)
    tier.check(
        "seconds until the whole job ended",
        round(res.seconds, 1),
        "<=",
        limit,
        source="configs/multigpu.yaml rank_failure_seconds_max",
    )
    tier.check("exit code of the job (non-zero: the failure is reported)", res.returncode not in (0, None), "==", True)
    # torchrun's "root cause" is the first failure it observed: when rank 0's collective fails at once on the
    # broken connection, that races with rank 1's own exit, so the check asks for rank 1's own error line instead.
    tier.check(
        "the report holds the failing rank's own error line ([rank1]: ... planted failure on rank 1)",
        "[rank1]: RuntimeError: planted failure on rank 1" in summary,
        "==",
        True,
        detail=summary,
    )


CONFIG_FSDP = CONFIG_DIR / "multigpu_fsdp.yaml"


def test_fsdp2_shards_a_7b_model_trains_and_its_peft_adapters_reload_on_one_gpu(tier, request, tmp_path):
    """FSDP2 (``fully_shard``) on the Llama-2-7B architecture: each rank's peak below the one-GPU peak by the
    sharding factor (``fsdp_peak_bound``), the loss falls, the base is untouched, and the adapters saved from the
    sharded model as a PEFT folder reload into a one-GPU model (this process) with logits equal to the sharded
    model's on the same probe batch (the same weights and kernels: bitwise). A third job plants the defect the
    memory bound exists for (layers kept gathered after forward) and must exceed the bound."""
    from safetensors.torch import load_file

    from lora_core.adapters import load_peft_adapter
    from lora_suite.scenarios.multigpu import fsdp_peak_bound

    n = gpus_for_run(request)
    cfg = tier.config("multigpu_fsdp")
    crit = cfg.criteria
    factor = crit.fsdp_sharding_factor or n
    if factor != n:
        pytest.fail(
            f"configs/multigpu_fsdp.yaml fsdp_sharding_factor: {factor}, but the job shards over all {n} ranks "
            f"(hybrid sharding is not implemented): set it to null or run with --gpus {factor}"
        )
    impl = tier.impl.name
    jobs = {}
    for name, nproc, batch, plant in (
        ("sharded", n, None, False),
        ("one GPU", 1, cfg.data.batch_size // n, False),
        ("planted: layers kept gathered after forward", n, None, True),
    ):
        jobs[name] = _run_job(
            tier,
            name,
            CONFIG_FSDP,
            tmp_path / name.split(":")[0].replace(" ", "_"),
            nproc,
            mode="fsdp",
            implementation=impl,
            batch_size=batch,
            plant_no_reshard=plant,
        )
    ranks, single = jobs["sharded"].ranks, jobs["one GPU"].ranks[0]
    tier.check("ranks that ran sharded (fully_shard)", sum(r["sharded"] for r in ranks), "==", n)
    tier.check(
        f"ranks not served by the implementation's path ({tier.impl.expected_path})",
        sum(r["served_by"] != tier.impl.expected_path for r in ranks),
        "==",
        0,
        detail=str(sorted({r["served_by"] for r in ranks})),
    )
    tier.check(
        "ranks whose frozen base weights changed (checksums of the gathered weights)",
        sum(not r["base_untouched"] for r in ranks),
        "==",
        0,
    )
    drop = loss_drop(ranks[0]["losses"], crit.loss_window)
    tier.check(
        f"{n}-GPU FSDP2 loss drop, mean of first {crit.loss_window} vs last {crit.loss_window} steps",
        round(drop, 4),
        ">=",
        crit.loss_drop_min,
        source="configs/multigpu_fsdp.yaml loss_drop_min",
    )
    terms = single["memory_terms"]
    peak_1 = single["peak_allocated_bytes"]
    bound = fsdp_peak_bound(peak_1, terms, factor)
    peak_n = max(r["peak_allocated_bytes"] for r in ranks)
    gib = 2**30
    tier.report.add_row(
        tier.nodeid,
        "FSDP2 memory (peak allocated over training, GiB)",
        (
            "GPUs",
            "rows per rank",
            "one-GPU peak P",
            "shardable S",
            "gathered at once T",
            "bound P - S(1-1/F) + T",
            "largest rank peak",
            "P / rank peak",
        ),
        (
            n,
            single["batch_size"],
            round(peak_1 / gib, 3),
            round(terms["sharded"] / gib, 3),
            round(terms["transient"] / gib, 3),
            round(bound / gib, 3),
            round(peak_n / gib, 3),
            round(peak_1 / peak_n, 3),
        ),
    )
    tier.check(
        f"largest per-rank peak over {n} FSDP2 ranks (GiB)",
        round(peak_n / gib, 3),
        "<=",
        round(bound / gib, 3),
        source=f"one-GPU peak {peak_1 / gib:.3f} GiB reduced by sharding factor {factor} "
        "(lora_suite.scenarios.multigpu.fsdp_peak_bound)",
    )
    planted = max(r["peak_allocated_bytes"] for r in jobs["planted: layers kept gathered after forward"].ranks)
    tier.check(
        "the bound's control: per-rank peak (GiB) of the same job with reshard_after_forward=False "
        "(a planted defect) exceeds the bound",
        round(planted / gib, 3),
        ">",
        round(bound / gib, 3),
        source="the check must fail on the defect it exists for",
    )
    tokens_n = sum(r["local_tokens_per_s"] for r in ranks)
    tier.report.add_row(
        tier.nodeid,
        "FSDP2 throughput (median tokens/s after warm-up)",
        ("GPUs", "tokens/s", "one GPU (B/N rows) tokens/s", "per-rank tokens/s / one GPU"),
        (
            n,
            round(tokens_n),
            round(single["local_tokens_per_s"]),
            round(tokens_n / n / single["local_tokens_per_s"], 3),
        ),
    )
    probe = load_file(str(tmp_path / "sharded" / "probe.safetensors"))
    prepared = tier.prepare(cfg)  # one GPU, the same seed: the same base weights, untrained adapters
    loaded = load_peft_adapter(prepared.model, tmp_path / "sharded" / "adapter")
    with torch.no_grad():
        logits = prepared.model(input_ids=probe["input_ids"].cuda()).logits.float().cpu()
    tier.check(
        "adapter layers loaded from the PEFT folder saved by the sharded model",
        len(loaded),
        "==",
        ranks[0]["n_adapters"] // 2,
    )
    tier.check(
        "max |logits(one GPU, reloaded) - logits(FSDP2 model)| on the probe batch",
        float((logits - probe["logits"]).abs().max()),
        "==",
        0.0,
        source="the same bf16 weights and fp32 adapters, the same kernels: bit-identical logits",
    )
