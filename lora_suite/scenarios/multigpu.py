"""Multi-GPU runs on torch.distributed (issue 11): the worker every rank runs, and the launcher (torchrun).

The tier test (tiers/multigpu) stays one pytest process that writes the report; it launches the runs with
``launch`` — ``python -m torch.distributed.run --nproc-per-node N -m lora_suite.scenarios.multigpu_worker ...`` — so a hung or
failed rank ends in a subprocess with a timeout and an exit code, never in the test process itself.

Worker modes (``--mode``):
    ddp     DistributedDataParallel over the adapters (the frozen base is not a DDP parameter). The global batch
            B of each step is split by rows: rank r trains rows [r·B/N, (r+1)·B/N). DDP averages the gradients,
            and with equal label counts per rank (fixed-length windows) the average of the ranks' mean losses is
            the global mean, so the N-rank run takes the same steps as one process with the whole batch, up to
            rounding (the GEMMs see other shapes). With one rank it is that one-process run.
            ``--plant-no-sync`` trains without DDP (each rank keeps its own gradients): the planted defect
            that the rank-agreement check must catch.
    fsdp    FSDP2 (``torch.distributed.fsdp.fully_shard``): every decoder layer is one FSDP unit and the model
            the root unit, so base weights, adapters, their gradients and AdamW's state are sharded over the
            ranks (``shard_model``); the batch is split by rows as for ddp. After training every rank takes
            part in saving the adapters as a PEFT folder (``<out>/adapter``, gathered from the shards by
            ``lora_core.adapters.save_peft_adapter``) and in a forward pass over a probe batch whose logits
            rank 0 writes (``<out>/probe.safetensors``) for the one-GPU reload check. ``--plant-no-reshard``
            keeps the layers gathered after forward: a planted defect for the memory check. The base weights are
            checked untouched by checksums (a full copy would be the 7B model again on every rank). With one
            rank nothing is sharded: that is the one-GPU reference whose peak memory the sharded run is held to.
    fail    the same as ddp, and rank ``--fail-rank`` raises at step ``--fail-at`` (a planted failure): the job
            must end, not hang on the next collective.
Each rank writes ``<out>/rank<r>.json``: its per-step global losses (the mean of the ranks' losses, all-reduced
after the run), local tokens/s, whether its base weights are bitwise untouched, and how many adapter tensors
differ from rank 0's (all-gathered, compared bitwise). Rank 0 also saves the adapters
(``<out>/adapters.safetensors``) for the comparison with the one-GPU run.

Environment of every launched process: ``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` keep
NVLink multicast (NVLS) off: the shared GPU hosts this suite runs on do not allow multicast objects, and NCCL or
symmetric memory that try to create them fail or hang at the first collective there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lora_suite.scenarios.process_tree import kill_tree

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}  # why: module docstring
MODES = ("ddp", "fsdp", "fail")


@dataclass(frozen=True)
class LaunchResult:
    nproc: int
    returncode: int | None  # None: killed at the timeout
    seconds: float
    stdout: str
    stderr: str
    ranks: list[dict]  # the rank<r>.json files that were written, in rank order

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def worker_args(
    config: str | Path,
    out: str | Path,
    *,
    mode: str = "ddp",
    implementation: str | None = None,
    device: str = "cuda",
    steps: int | None = None,
    perturb: float = 0.0,
    fail_rank: int = 1,
    fail_at: int = 3,
    batch_size: int | None = None,
    plant_no_reshard: bool = False,
    plant_no_sync: bool = False,
) -> list[str]:
    """The worker's module and arguments (``-m lora_suite.scenarios.multigpu_worker ...``), what follows torchrun's own
    options on every node."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    cmd = ["-m", "lora_suite.scenarios.multigpu_worker", "--config", str(config), "--out", str(out), "--mode", mode]
    cmd += ["--device", device, "--perturb", repr(perturb), "--fail-rank", str(fail_rank), "--fail-at", str(fail_at)]
    if implementation:
        cmd += ["--implementation", implementation]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if batch_size is not None:
        cmd += ["--batch-size", str(batch_size)]
    if plant_no_reshard:
        cmd += ["--plant-no-reshard"]
    if plant_no_sync:
        cmd += ["--plant-no-sync"]
    return cmd


def launch_command(config: str | Path, out: str | Path, nproc: int, **worker) -> list[str]:
    """The torchrun command line of one run on this host (``--standalone``: a local rendezvous on a free port);
    ``worker``: the options of ``worker_args``."""
    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be >= 1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return torchrun + worker_args(config, out, **worker)


def launch_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the launched processes: the caller's, with NVLink multicast off (module docstring)."""
    env = dict(os.environ if base is None else base)
    env.update(MULTICAST_OFF)
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # a failed collective raises instead of hanging
    return env


def launch(config: str | Path, out: str | Path, nproc: int, *, timeout_s: float, **kw) -> LaunchResult:
    """Run one job under torchrun; kill it at ``timeout_s``. Never raises for a failed job: the result says."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = launch_command(config, out, nproc, **kw)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env(), start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # torchrun and every worker (each rank runs in a session of its own)
        stdout, stderr = proc.communicate()
        rc = None
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"), key=lambda p: int(p.stem[4:]))]
    return LaunchResult(nproc, rc, time.perf_counter() - t0, stdout, stderr, ranks)


def failure_summary(result: LaunchResult) -> str | None:
    """What the job's output says failed (``failure_lines`` of its stderr and stdout)."""
    return failure_lines(result.stderr + "\n" + result.stdout)


def failure_lines(text: str) -> str | None:
    """torchrun's root-cause rank and each rank's first error line (``[rankN]: SomeError: message``) in ``text``, a
    job's output; None when there is neither."""
    import re

    first: dict[str, str] = {}
    for ln in text.splitlines():
        m = re.match(r"\[rank(\d+)\]: \w+(\.\w+)*(Error|Exception)\b", ln)
        if m and m.group(1) not in first:
            first[m.group(1)] = ln.strip()
    root = re.search(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+)", text, re.S)
    parts = ([f"root cause: rank {root.group(1)}"] if root else []) + [first[r] for r in sorted(first, key=int)]
    return "; ".join(parts) or None


def scaling_efficiency(tokens_per_s_n: float, nproc: int, tokens_per_s_1: float) -> float:
    """Tokens/s of the N-GPU run ÷ (N × tokens/s of the one-GPU run): 1.0 is perfect scaling."""
    return tokens_per_s_n / (nproc * tokens_per_s_1)


def adapter_mismatches(adapters: dict, group=None) -> list[str]:
    """Names of the adapter tensors that differ bitwise from rank 0's (every rank gets the same list)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    differ = []
    for name in sorted(adapters):
        t = adapters[name].detach().contiguous()
        gathered = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(gathered, t, group=group)
        if any(not torch.equal(gathered[0], g) for g in gathered[1:]):
            differ.append(name)
    return differ


def adapter_gaps(multi: dict, single: dict, control: dict, factor: float, floor: float) -> tuple[list, list[str]]:
    """The N-GPU run's adapters against the one-GPU run's, within a band set by the control run.

    Per adapter tensor, the relative gap d(X) = ‖X − single‖ / ‖single‖ (Frobenius norms) of the N-GPU run and
    of the control (the one-GPU run started from lora_A perturbed at bf16 roundoff): the N-GPU tensor must stay
    within max(factor · d(control), floor), the convergence tier's band applied to the trained adapters instead
    of the losses. Returns (rows (name, d_multi, d_control, tolerance), names beyond the band).
    """
    if set(multi) != set(single) or set(control) != set(single):
        raise ValueError(
            f"the runs saved different adapters: {sorted(set(multi) ^ set(single))[:5]} / "
            f"{sorted(set(control) ^ set(single))[:5]}"
        )
    rows, beyond = [], []
    for name in sorted(single):
        ref = single[name].double()
        norm = float(ref.norm()) or 1.0
        d_multi = float((multi[name].double() - ref).norm()) / norm
        d_control = float((control[name].double() - ref).norm()) / norm
        tol = max(factor * d_control, floor)
        rows.append((name, d_multi, d_control, tol))
        if not d_multi <= tol:  # NaN counts as beyond
            beyond.append(name)
    return rows, beyond


def rank_rows(batch: dict, rank: int, world: int) -> dict:
    """Rank ``rank``'s share of a global batch: its contiguous block of B/N rows (B must divide by N)."""
    rows = batch["input_ids"].shape[0]
    if rows % world:
        raise ValueError(
            f"the global batch has {rows} rows, not divisible by {world} ranks: set data.batch_size "
            f"to a multiple of the number of GPUs"
        )
    per = rows // world
    return {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}


# ------------------------------------------------------------------------------------------- FSDP2
def decoder_layers(model) -> list:
    """The repeated blocks of a causal LM (``model.model.layers`` in transformers' Llama family): FSDP units."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or len(layers) == 0:
        raise ValueError(
            f"{type(model).__name__} has no model.layers: the fsdp mode shards a transformers causal LM "
            "of the Llama family, one FSDP unit per decoder layer"
        )
    return list(layers)


def shard_model(model, mesh=None, *, reshard_after_forward: bool = True) -> None:
    """FSDP2 in place: ``fully_shard`` each decoder layer, then the model (the root unit: embeddings, final norm,
    LM head). Each parameter, frozen or not, becomes a DTensor sharded on dim 0 over the mesh's ranks.

    ``reshard_after_forward=False`` keeps every layer gathered from its forward to its backward: the planted
    defect (``--plant-no-reshard``) that the per-rank peak bound must catch."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_terms(model, adapters: dict) -> dict[str, int]:
    """The byte counts ``fsdp_peak_bound`` needs, from the unsharded model (before ``shard_model``).

    sharded     every parameter (base and adapters) + the adapters' gradients + AdamW's two moments (fp32,
                like the adapters): what FSDP2 divides over the ranks
    transient   what a rank holds unsharded at once: the root unit's own parameters (FSDP2 keeps the root
                gathered between forward and backward) + three decoder layers: the one running, and for the
                next one (prefetched) both FSDP2's flat all-gather buffer and the per-parameter tensors it is
                copied out into (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py,
                ``foreach_all_gather_copy_out`` allocates those before it copies). The first FSDP2 run on two
                H200s counted two layers and its rank peak exceeded that bound by 0.16 GiB, less than the one
                layer (0.38 GiB) left out (reports/20261122T105603Z-multigpu).
    """
    params = _nbytes(model.parameters())
    adapter = _nbytes(adapters.values())
    root_own = _nbytes(p for n, p in model.named_parameters() if ".layers." not in f".{n}")
    largest_layer = max(_nbytes(layer.parameters()) for layer in decoder_layers(model))
    return {
        "sharded": params + 3 * adapter,
        "transient": root_own + 3 * largest_layer,
        "params": params,
        "adapters": adapter,
        "root_own_params": root_own,
        "largest_layer_params": largest_layer,
    }


def fsdp_peak_bound(peak_one_gpu: float, terms: dict[str, int], factor: int) -> float:
    """The most a rank of an FSDP2 run may hold at its peak, in bytes.

    The one-GPU run (same per-rank batch, nothing sharded) peaks at P = S + R, S the shardable bytes
    (``memory_terms``) and R the rest (activations, logits, scratch), which sharding leaves as it is. Sharded
    F ways, a rank keeps S/F of S and adds what it gathers at once, T (``memory_terms`` "transient"):
        peak_rank <= P - S·(1 - 1/F) + T
    An FSDP run that does not shard (a unit left unwrapped, parameters kept gathered after use) keeps most of
    S and lands well above this bound when S·(1 - 1/F) is much more than T, as for a 7B model on two GPUs.
    """
    from lora_suite.measure.sharded_memory import sharded_peak  # the derivation, once (its docstring)

    return sharded_peak(peak_one_gpu, terms["sharded"], terms["transient"], factor)


def as_bits(t):
    """``t``'s bits as integers of its element's width (a view, no copy): what a checksum or a digest reads, so that
    -0.0 and 0.0, or two NaNs of other payloads, differ as they do in memory."""
    import torch

    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def base_checksums(model) -> dict[str, tuple[float, float]]:
    """Per frozen parameter, two sums over its bits (plain and position-weighted), taken on the whole tensor
    (gathered when sharded: a collective, every rank calls it). Equal before and after training: untouched."""
    import torch

    from lora_core.adapters import full_tensor

    sums = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        v = as_bits(full_tensor(p.detach()).contiguous().view(-1)).to(torch.float64)
        pos = torch.arange(1, v.numel() + 1, device=v.device, dtype=torch.float64) % 65521
        sums[name] = (float(v.sum()), float((v * pos).sum()))
    return sums


# ------------------------------------------------------------------------------------------- the worker
