"""GPU memory: a LoRA-aware training-memory estimate, the measured split, one run's own peak, and the host's memory
readings. NVML readings live in ``lora_suite.measure.nvml``; the leak-slope fit in ``lora_suite.measure.leak_fit``.

Estimate of the peak torch-allocated memory of one LoRA training step (bytes):

    weights      = Σ base params · bytes(storage)    (16-bit, or NF4: ½ byte + quant state per param)
    adapters     = Σ_targets r·(in + out) · bytes(adapter dtype);  gradients: the same again
    optimizer    = AdamW: 2 fp32 moments per adapter param (8 bytes)
    activations  = tokens · L · (20·H + 8·I) bytes without checkpointing;
                   tokens · (L · 2·H + (20·H + 8·I)) with it (layer inputs kept, one layer recomputed)
    logits       = tokens · V · 14 bytes (bf16 logits, their fp32 copy, log-softmax, and both gradients)
    dequant      = NF4 only: one 16-bit copy of the largest quantised weight (the scratch buffer). Under
                   checkpointing lora_core keeps the bases a layer's recompute dequantised until that layer's
                   backward (lora_core.ops.recompute): up to one layer's bases at once, not modelled here
                   (Llama-2-7B: the 6 bases a layer's recompute reruns, 0.29 GiB, 0.21 GiB above this term)

The per-token constants count the tensors a Llama block saves for backward in bf16: the two RMSNorms
(fp32 input + bf16 output: 6H each), attention (q, k, v expanded to H each, and the output: 8H), the MLP
(gate, up, silu(gate), silu(gate)·up: 8I). The CUDA context is outside torch's allocator but counts
against NVML's free memory: ``context`` (0.6 GiB, typical for CUDA 12/13 with cuBLAS loaded) is added for
the --check-vram comparison. torch's cuBLAS workspaces are inside its allocator (one per cuBLAS handle and
stream, 32 MiB each on Hopper: the forward's thread and autograd's each have a handle) and so in the
measured peak, not in this estimate. Reports show this estimate against the measured peak with the error
in percent.

One run's own peak (``PeakWindow``): ``torch.cuda.max_memory_allocated`` counts everything allocated in the
process, including what earlier work left behind. Within one pytest process the largest such remainder is
torch's cached cuBLAS workspaces: a run that trains on a new stream (a captured run's side stream) leaves two
32 MiB workspaces allocated for the rest of the process (measured on an H100 in the 7B bench order: +64 MiB
after each captured run, which had put the later runs' peaks 0.06-0.19 GiB above PEFT's, the first run's,
though each run alone peaks at the same 14.448 GiB). A window therefore starts by releasing those workspaces
(as torch's own CUDA leak check does), and the run's peak is ``max_memory_allocated − carried``, where
``carried`` is what is still allocated at the start; reports show ``carried`` beside the peak.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
from dataclasses import asdict, dataclass

import torch

from lora_suite.measure.card import CONTEXT_BYTES, GIB  # noqa: F401 (GIB re-exported: the suite's unit)
from lora_suite.settings.config import AdapterSpec, LlamaArchitecture

MIB = 2**20
NF4_BITS_PER_PARAM = 4.127  # 4-bit codes + 8-bit absmax per 64 + fp32 per 256 absmaxes (QLoRA double quant)
_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


# ---------------------------------------------------------------------------------------------- estimate
@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    quant_state: int
    adapters: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    dequant_scratch: int
    context: int = CONTEXT_BYTES

    @property
    def allocated_peak(self) -> int:
        """Predicted peak of torch.cuda.max_memory_allocated."""
        return sum(v for k, v in asdict(self).items() if k != "context")

    @property
    def device_need(self) -> int:
        """What NVML must have free: the allocated peak, 10% allocator slack, and the CUDA context."""
        return int(self.allocated_peak * 1.10) + self.context

    def gib(self) -> dict[str, float]:
        parts = {k: round(v / GIB, 3) for k, v in asdict(self).items()}
        parts["allocated_peak"] = round(self.allocated_peak / GIB, 3)
        return parts


def linear_shapes(arch: LlamaArchitecture) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of one Llama block."""
    h, i, kv = arch.hidden_size, arch.intermediate_size, arch.num_key_value_heads * arch.head_dim
    q = arch.num_attention_heads * arch.head_dim  # h, but where a head is wider or narrower than h / heads (Gemma 2)
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def estimate_tier(cfg, **changes) -> MemoryEstimate:
    """``estimate_training_memory`` of a tier's settings (``cfg``, a TierConfig), with ``changes`` to its batch size,
    sequence length or gradient checkpointing (what an out-of-memory verdict tries: ``lora_suite.measure.oom``)."""
    settings = {
        "batch_size": cfg.data.batch_size,
        "seq_len": cfg.data.seq_len,
        "gradient_checkpointing": cfg.train.gradient_checkpointing,
    }
    return estimate_training_memory(cfg.model.architecture, cfg.lora, dtype=cfg.dtype, **{**settings, **changes})


def estimate_training_memory(
    arch: LlamaArchitecture,
    lora: AdapterSpec,
    *,
    batch_size: int,
    seq_len: int,
    gradient_checkpointing: bool,
    dtype: str = "bfloat16",
) -> MemoryEstimate:
    wbytes = _DTYPE_BYTES[dtype]
    abytes = _DTYPE_BYTES[lora.dtype_name or dtype]  # None: the base weight's dtype
    shapes = linear_shapes(arch)
    layers, h, v = arch.num_hidden_layers, arch.hidden_size, arch.vocab_size
    linear_params = layers * sum(i * o for i, o in shapes.values())
    other_params = v * h * (1 if arch.tie_word_embeddings else 2) + (2 * layers + 1) * h
    targets = tuple(shapes) if "all-linear" in lora.targets else lora.targets
    adapter_params = layers * sum(lora.r * (shapes[t][0] + shapes[t][1]) for t in targets)
    if lora.quantize == "nf4":
        weights = math.ceil(linear_params / 2) + other_params * wbytes
        quant_state = math.ceil(linear_params * (NF4_BITS_PER_PARAM - 4) / 8)
        dequant = max(i * o for i, o in shapes.values()) * wbytes
    else:
        weights, quant_state, dequant = (linear_params + other_params) * wbytes, 0, 0
    tokens = batch_size * seq_len
    per_layer_token = 20 * h + 8 * arch.intermediate_size  # bytes, bf16 saved tensors (see module docstring)
    if gradient_checkpointing:
        activations = tokens * (layers * 2 * h + per_layer_token)
    else:
        activations = tokens * layers * per_layer_token
    return MemoryEstimate(
        weights=weights,
        quant_state=quant_state,
        adapters=adapter_params * abytes,
        gradients=adapter_params * abytes,
        optimizer=adapter_params * 8,
        activations=activations,
        logits=tokens * v * 14,
        dequant_scratch=dequant,
    )


def measured_split(model, optimizer, peak_allocated: int, adapters: dict | None = None) -> dict[str, int]:
    """Bytes of each part of a training run's peak, read off the live objects; the remainder of the peak
    (activations, logits, the NF4 dequantisation scratch and allocator rounding) is ``activations_and_scratch``.
    ``adapters``: the implementation's adapter parameters (default: lora_core's layers in ``model``)."""
    if adapters is None:
        from lora_core.inject import adapter_parameters

        adapters = adapter_parameters(model)
    adapter_ids = {id(p) for p in adapters.values()}
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    seen, weights = set(), 0
    for p in model.parameters():
        if id(p) not in adapter_ids and id(p) not in seen:  # tied embeddings count once
            seen.add(id(p))
            weights += nbytes(p)
    packed = quant_state = 0
    for name, buf in model.named_buffers():
        if name.endswith("weight_packed"):
            packed += nbytes(buf)
        elif ".weight_absmax" in name:
            quant_state += nbytes(buf)
    split = {
        "weights": weights + packed,
        "quant_state": quant_state,
        "adapters": sum(nbytes(p) for p in adapters.values()),
        "gradients": sum(nbytes(p.grad) for p in adapters.values() if p.grad is not None),
        "optimizer": sum(nbytes(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)),
    }
    split["activations_and_scratch"] = peak_allocated - sum(split.values())
    return split


@dataclass(frozen=True)
class PeakWindow:
    """One run's peak of torch-allocated memory, net of what earlier work in the process left allocated."""

    carried: int  # bytes still allocated when the window opened (not this run's)
    released: int  # bytes of cached cuBLAS workspaces that opening the window released
    device: torch.device | str | None = None  # as torch.cuda takes it: None is the current device

    @classmethod
    def open(cls, device: torch.device | str | None = None) -> PeakWindow:
        """Collect garbage, release torch's cached cuBLAS workspaces and the allocator's cache, reset the peak.

        Call it between runs only: a CUDA graph that is still to be replayed may use a workspace it releases.
        """
        gc.collect()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # absent from CPU-only builds of torch
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        carried = torch.cuda.memory_allocated(device)
        return cls(carried=carried, released=before - carried, device=device)

    def peak(self) -> int:
        """Bytes: the window's peak of ``torch.cuda.max_memory_allocated`` minus ``carried``."""
        return torch.cuda.max_memory_allocated(self.device) - self.carried


def vram_verdict(
    estimate: MemoryEstimate, free_bytes: int, used_bytes: int | None = None, limit_gib: float | None = None
) -> tuple[bool, str]:
    """(enough?, message giving need and free) for the --check-vram pre-check. NVML's free memory is what is left
    after every process on the GPU, this one and others (``used_bytes``), so a neighbour's memory counts, and the
    message says how much was already held; under ``--vram-limit`` (``limit_gib``) ``free_bytes`` is the card's
    (``vram_limit.limited_free``) and the message names the card."""
    need = estimate.device_need
    ok = need <= free_bytes
    parts = ", ".join(f"{k} {v:.2f}" for k, v in estimate.gib().items() if v)
    msg = (
        f"VRAM pre-check: need ~{need / GIB:.2f} GiB (estimated peak {estimate.allocated_peak / GIB:.2f} GiB "
        f"+10% allocator slack + {estimate.context / GIB:.1f} GiB CUDA context; {parts}), NVML free "
        f"{free_bytes / GIB:.2f} GiB"
        + (
            ""
            if used_bytes is None
            else f" (after {used_bytes / GIB:.2f} GiB already held on the GPU, other processes' included)"
        )
        + ("" if limit_gib is None else f", as on a {limit_gib:g} GiB card (--vram-limit)")
        + f": {'enough' if ok else 'NOT enough'}"
    )
    return ok, msg


# ---------------------------------------------------------------------------------------------- host memory
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def host_rss_bytes(statm: str = "/proc/self/statm") -> int | None:
    """The process's resident set size now (Linux: /proc/self/statm, its second field in pages); None elsewhere.

    A host-side leak (per-step Python objects or pinned buffers kept alive) grows it step by step, as a device
    leak grows torch's allocated memory; the extended tier fits its slope beside the CUDA and NVML ones.
    """
    try:
        with open(statm) as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2():
    try:
        fn = ctypes.CDLL(None).mallinfo2  # glibc >= 2.33
    except (AttributeError, OSError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()


def host_heap_bytes() -> int | None:
    """Bytes of the C heap in use now (glibc ``mallinfo2``: allocated chunks in every arena + mmapped blocks), or None
    without glibc >= 2.33. Python objects, pymalloc's arenas and native libraries' buffers all live there.

    The host counterpart of torch's allocated memory, as the resident set size is of its reserved memory: memory a
    process freed earlier stays resident (glibc keeps it for reuse), so a later leak is served from it and does not
    grow the RSS until that pool is used up (seen on an H200: a planted 1 MiB/step leak grew the RSS 1.28 MiB/step in
    a fresh process and 0.02-0.07 MiB/step after earlier tests had freed memory). Bytes in use grow either way.
    """
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd
