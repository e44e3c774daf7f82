"""Where an eager training step's device time goes (the fused table's kernel profiles, issue 27): ``profile_steps``
runs a prepared model's step (forward through the loss, backward, fused AdamW over the adapters) under
``torch.profiler`` and returns a ``StepProfile``: the summed kernel time per step, that time by kernel kind
(``KERNEL_KINDS``: whose code the kernel is, lora_core's CUDA, Unsloth's or Liger's Triton, cuBLAS, ...), each
kernel per step and each launching host op's own device time per step. Beside it, the step's span: the median
CUDA-event time of a step taken just before the profile (``span_ms``, the eager step a reader compares stacks by)
and of the profiled steps (``profiled_span_ms``, the profiler's own host cost included). The span less the kernel
time is the time the GPU waited for the host (the host-bound gap, ``gap_share``).

A stack that patches transformers for its whole process (Unsloth) is profiled in a child process
(``fused_child.profile_in_child``); its profile comes back as JSON (``profile_to_json`` / ``profile_from_json``),
its top kernels and host ops only (``TOP_KERNELS``, ``TOP_OPS``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

import torch

TOP_KERNELS = 12
TOP_OPS = 15
OTHER_KIND = "other (elementwise, copies, reductions)"
# (kind, keys), first match wins. A key is a substring of the kernel's lower-cased name; a key written "^name" must
# begin it (a Triton kernel is named by its function: Unsloth's _cross_entropy_forward is inside Liger's
# liger_cross_entropy_forward_kernel, and its _rope_embedding_QK would match Liger's "_rope").
KERNEL_KINDS = (
    # the template bracket: Liger's Triton kernels are named _swiglu_forward_kernel / _swiglu_backward_kernel
    (
        "LoRA SwiGLU/GeGLU (swiglu.cu)",
        ("swiglu_forward<", "swiglu_backward_inplace<", "geglu_forward<", "geglu_backward_inplace<"),
    ),
    # lora_core's fused loss: before Liger's kind, whose "cross_entropy" key took it (a Qwen2 step's 11.8 ms read as
    # Liger's where no Liger op ran: run 20261127T230024Z-bench)
    ("LoRA fused loss (cross_entropy.cu)", ("cross_entropy_rows<",)),
    ("adapter casts (cast.cu)", ("cast_stack_from_f32", "cast_pair_from_f32")),
    ("NF4 dequantisation (nf4.cu)", ("nf4_dequantize", "nf4_quantize", "absmax_quantize")),
    (  # unsloth/kernels/*.py: RMSNorm, RoPE, SwiGLU (_fg_kernel, _DWf_DW_dfg_kernel), GEGLU, cross-entropy, NF4
        "Unsloth (Triton)",
        (
            "^_rms_layernorm",
            "^_gemma_rms_layernorm",
            "^_add_rms_layernorm",
            "^_rms_sum_dw_partials",
            "^_rope_embedding",
            "^_qk_norm_rope",
            "^_fg_kernel",
            "^_dwf_dw_dfg_kernel",
            "^_exact_forward_kernel",
            "^_exact_backward_kernel",
            "^_approx_forward_kernel",
            "^_approx_backward_kernel",
            "^_cross_entropy_",
            "^_chunked_cross_entropy_",
            "^_nf4_dequant_kernel",  # fast_dequantize's kernel
            "^_gemv_nf4",
        ),
    ),
    # kernels torch.compile generated (Unsloth compiles its chunked fused cross-entropy, unsloth_fused_ce_loss)
    ("torch.compile (Inductor Triton)", ("^triton_poi_", "^triton_red_", "^triton_per_", "^triton_tem_")),
    ("Liger (Triton)", ("liger", "_rms_norm", "_rope", "_swiglu", "fused_linear", "cross_entropy", "_geglu")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("GEMM (cuBLAS)", ("gemm", "nvjet", "cutlass", "sm90_xmma", "sm80_xmma", "cublas")),
    ("optimizer", ("adam", "multi_tensor")),
)


def _matches(low: str, key: str) -> bool:
    return low.startswith(key[1:]) if key.startswith("^") else key in low


def kernel_kind(name: str) -> str:
    """The kind (``KERNEL_KINDS``) of a profiled kernel's name, ``OTHER_KIND`` where no key matches."""
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(_matches(low, k) for k in keys):
            return kind
    return OTHER_KIND


class StepProfile(NamedTuple):
    total_ms: float  # summed kernel time per step
    kinds: dict[str, float]  # ms per step by kernel kind (KERNEL_KINDS)
    kernels: list  # benchmarking.KernelTime per kernel, most time first
    ops: list  # benchmarking.OpTime per launching host op (self device time), most time first
    span_ms: float  # median CUDA-event time of an eager step, unprofiled
    profiled_span_ms: float  # the same of the profiled steps
    host: tuple = ()  # benchmarking.OpTime per CUDA runtime/driver call: host ms per step, most time first


def gap_share(prof: StepProfile) -> float | None:
    """The share of the eager step in which no kernel ran (the host-bound gap): 1 - kernel ms / step ms."""
    return None if prof.span_ms <= 0 else 1 - prof.total_ms / prof.span_ms


def eager_step(prepared, cfg):
    """One eager training step of ``prepared`` (forward, backward, fused AdamW step), checkpointed when the case is,
    as the fused table runs it: the callable, the model put in training mode first."""
    model = prepared.model
    model.train()
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(list(prepared.adapters.values()), lr=cfg.train.lr, fused=True)
    batch = prepared.batches(0)

    def step():
        model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def profile_steps(prepared, cfg, steps: int = 3) -> StepProfile:
    """Where ``steps`` eager training steps spend their device time, checkpointed when the case is (as ``eager_run``
    and the captured runs: the profile is of the step whose time is reported); after 3 warm-up steps, ``steps``
    unprofiled steps are timed (``span_ms``) and then ``steps`` are profiled (and timed, ``profiled_span_ms``)."""
    from torch.profiler import ProfilerActivity, profile

    from lora_suite.measure.timing import cuda_time

    step = eager_step(prepared, cfg)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    span = cuda_time(step, warmup=0, reps=steps).median_ms
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        profiled_span = cuda_time(step, warmup=0, reps=steps).median_ms
    return profile_of(prof, steps, span, profiled_span)


def profile_of(prof, steps: int, span_ms: float, profiled_span_ms: float) -> StepProfile:
    """The ``StepProfile`` of a finished ``torch.profiler`` session that ran ``steps`` steps (CPU and CUDA
    activity), beside the steps' spans: kernels and their kinds, launching ops and CUDA calls, per step."""
    from lora_suite.engine.benchmarking import host_calls, kernel_profile, op_profile

    total, kernels = kernel_profile(prof, steps)
    kinds: dict[str, float] = {}
    for k in kernels:
        kind = kernel_kind(k.name)
        kinds[kind] = kinds.get(kind, 0.0) + k.ms
    ops, host = op_profile(prof, steps), tuple(host_calls(prof, steps))
    return StepProfile(total, kinds, kernels, ops, span_ms, profiled_span_ms, host)


# A step in which no kernel ran for more than this share of its span waited on its host (a tenth of the step): its
# eager time then measures the host's speed as much as the GPU work, and a ratio of two such times the hosts'.
HOST_BOUND_GAP = 0.10
KERNEL_AGAINST_COLUMNS = (
    "kernel-time speed-up",
    "eager step speed-up",
    "gap share, stack",
    "gap share, against",
    "reading",
)


def kernel_time_against(own: StepProfile, base: StepProfile, target: float) -> tuple:
    """``KERNEL_AGAINST_COLUMNS`` of a stack's profile against a base stack's (one profile each): the speed-up on
    summed kernel time (base / own: the GPU work alone, what no host can move), on the eager step, both gap shares,
    and how to read the pair: which of them is host-bound (``HOST_BOUND_GAP``) and whether the kernel-time speed-up
    reaches ``target`` (one profile a side: no spread is claimed)."""
    kernel = base.total_ms / own.total_ms if own.total_ms > 0 else None
    step = base.span_ms / own.span_ms if own.span_ms > 0 else None
    gaps = gap_share(own), gap_share(base)
    bound = [who for who, g in zip(("stack", "against"), gaps) if g is not None and g > HOST_BOUND_GAP]
    host = f"host-bound ({' and '.join(bound)}): the eager ratio is partly the host's" if bound else "GPU-bound"
    met = "n/a" if kernel is None else ("reaches" if kernel >= target else "below")
    rnd = [None if v is None else round(v, 3) for v in (kernel, step, *gaps)]
    return (*rnd, f"{host}; kernel time {met} the {target}x target")


def profile_to_json(prof: StepProfile) -> dict:
    """``prof`` as JSON-ready data: every figure, its top ``TOP_KERNELS`` kernels and ``TOP_OPS`` host ops (the
    kinds and the total still sum every kernel)."""
    return {
        "total_ms": prof.total_ms,
        "kinds": dict(prof.kinds),
        "kernels": [dataclasses.asdict(k) for k in prof.kernels[:TOP_KERNELS]],
        "ops": [dataclasses.asdict(o) for o in prof.ops[:TOP_OPS]],
        "span_ms": prof.span_ms,
        "profiled_span_ms": prof.profiled_span_ms,
        "host": [dataclasses.asdict(o) for o in prof.host[:TOP_OPS]],
    }


def profile_from_json(data: Mapping) -> StepProfile:
    """The ``StepProfile`` that ``profile_to_json`` wrote; a field missing or not of its shape raises a ValueError
    naming it."""
    from lora_suite.engine.benchmarking import KernelTime, OpTime

    fields = set(StepProfile._fields)
    if set(data) != fields:
        raise ValueError(f"a step profile has the fields {sorted(fields)}, got {sorted(data)}")
    try:
        kernels = [KernelTime(str(k["name"]), float(k["launches"]), float(k["ms"])) for k in data["kernels"]]
        ops = [OpTime(str(o["name"]), float(o["calls"]), float(o["ms"])) for o in data["ops"]]
        kinds = {str(kind): float(ms) for kind, ms in data["kinds"].items()}
        spans = float(data["span_ms"]), float(data["profiled_span_ms"])
        host = [OpTime(str(o["name"]), float(o["calls"]), float(o["ms"])) for o in data["host"]]
        return StepProfile(float(data["total_ms"]), kinds, kernels, ops, *spans, tuple(host))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(
            f"a step profile not of its shape ({type(exc).__name__}: {exc}): {dict(data)!r}"[:600]
        ) from exc
