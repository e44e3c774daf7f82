"""What the benchmarks measure, as functions (the bench suites and the planted-defect self-test call them).

- ``layer_step(impl, ...)``: one forward+backward of a LoRA linear layer (or the frozen base alone) in bf16.
- ``ratio_rounds``: per-round CUDA-event medians of the base layer and several implementations, taken in
  turns (``timing.interleaved_rounds``), as ratios to the base layer of the same round.
- ``kernel_profile``: the CUDA kernels that ran under a ``torch.profiler`` session, per call of the profiled
  work (summed device time, launches), most time first.
- ``dequant_vs_copy``: NF4 dequantisation time against a device-to-device copy moving the same number of
  bytes (read + written), per round: fraction = t_copy / t_dequant = bandwidth(dequant) / bandwidth(copy).
  A copy of the same size is the right yardstick: a 1 GiB copy reaches a higher bandwidth than any
  ~100 MB transfer, which charged the kernel for the size of the problem.

Noise allowance of a bar on these per-round values (``PairedEstimate``): it passes when the median is on
the right side of the bar by more than −NOISE_Z standard errors of that median, and a failing bar is
measured again (``timing.measure_until_pass``) before it fails.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

import lora_core
from lora_core.nf4 import dequantize_nf4, quantize_nf4
from lora_suite.measure.timing import PairedEstimate, interleaved_rounds

NOISE_Z = 3.0  # 3 standard errors: the same allowance as the extended tier's drift (configs/extended.yaml)
DT = torch.bfloat16


def layer_step(impl: str, batch: int, seq: int, k: int, o: int, r: int, device="cuda") -> Callable[[], object]:
    """A closure doing one forward+backward; inputs are built once, outside the timing. bf16 adapters on every row."""
    linear = torch.nn.Linear(k, o, bias=False, device=device, dtype=DT).requires_grad_(False)
    x = torch.randn(batch, seq, k, device=device, dtype=DT, requires_grad=True)
    dy = torch.randn(batch, seq, o, device=device, dtype=DT)
    if impl == "base":
        return lambda: torch.autograd.grad(linear(x), (x,), dy)
    if impl == "peft":
        import peft

        model = peft.get_peft_model(
            torch.nn.Sequential(linear),
            peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["0"], lora_dropout=0.0),
            autocast_adapter_dtype=False,
        )
        layer: torch.nn.Module = model.get_submodule("base_model.model.0")
        weights = dict(layer.named_parameters())
        params = (x, weights["lora_A.default.weight"], weights["lora_B.default.weight"])
        torch.nn.init.normal_(params[2], std=0.02)
    else:
        quantize = "nf4" if impl == "cupy-nf4" else None
        lora = lora_core.LoRALinear.from_linear(
            linear, r=r, alpha=2 * r, backend=impl.split("-")[0], adapter_dtype=DT, quantize=quantize
        )
        torch.nn.init.normal_(lora.lora_B, std=0.02)
        params, layer = (x, lora.lora_A, lora.lora_B), lora
    if not all(p.dtype == DT for p in params[1:]):
        raise AssertionError("every row runs bf16 adapters")
    return lambda: torch.autograd.grad(layer(x), params, dy)


def implementation_step(impl, batch: int, seq: int, k: int, o: int, r: int, device="cuda") -> Callable[[], object]:
    """One forward+backward of a layer that ``impl`` (a lora_suite.implementations.LoRAImplementation) adapted:
    a module holding one bf16 linear named q_proj, injected through the contract; bf16 adapters, B ~ N(0, 0.02)."""
    from lora_suite.implementations import AdapterSpec

    holder = torch.nn.Module()
    holder.q_proj = torch.nn.Linear(k, o, bias=False, device=device, dtype=DT).requires_grad_(False)
    impl.inject(holder, AdapterSpec(("q_proj",), r, 2 * r, adapter_dtype=DT))
    adapters = impl.adapter_parameters(holder)
    torch.nn.init.normal_(adapters["q_proj.lora_B"], std=0.02)
    x = torch.randn(batch, seq, k, device=device, dtype=DT, requires_grad=True)
    dy = torch.randn(batch, seq, o, device=device, dtype=DT)
    params = (x, adapters["q_proj.lora_A"], adapters["q_proj.lora_B"])
    adapted = holder.get_submodule("q_proj")  # the layer inject put in place of the linear
    return lambda: torch.autograd.grad(adapted(x), params, dy)


def ratio_rounds(steps: dict[str, Callable[[], object]], *, rounds: int = 7, reps: int = 15) -> dict[str, list[float]]:
    """Per-round ratio of each step's time to the ``"base"`` step's time in the same round."""
    ms = interleaved_rounds(steps, rounds=rounds, reps=reps)
    return {name: [t / b for t, b in zip(times, ms["base"])] for name, times in ms.items() if name != "base"}


def paired_difference(a: list[float], b: list[float]) -> PairedEstimate:
    """Per-round a − b (e.g. cupy's ratio − PEFT's): its median and standard error."""
    return PairedEstimate.of([x - y for x, y in zip(a, b)])


@dataclass(frozen=True)
class KernelTime:
    name: str
    launches: float  # per call of the profiled work
    ms: float  # device time per call


@dataclass(frozen=True)
class OpTime:
    name: str  # the host-side op (``aten::mul``, an autograd Function's name)
    calls: float  # per call of the profiled work
    ms: float  # its own kernels' device time per call of the profiled work


def kernel_profile(prof, calls: int) -> tuple[float, list[KernelTime]]:
    """(summed kernel ms per call, each kernel per call, most time first) from a finished
    ``torch.profiler.profile(activities=[ProfilerActivity.CUDA])`` session that ran the work ``calls`` times."""
    kernels = [
        KernelTime(e.key, e.count / calls, e.self_device_time_total / calls / 1e3)
        for e in prof.key_averages()
        if e.device_type.name == "CUDA" and e.self_device_time_total > 0
    ]
    kernels.sort(key=lambda k: k.ms, reverse=True)
    return sum(k.ms for k in kernels), kernels


def op_profile(prof, calls: int) -> list[OpTime]:
    """Device time per call by the host-side op that launched it, most time first, from a finished profile that
    recorded CPU and CUDA activity: each op's *self* device time (its own kernels, not its child ops'), so that
    the "other" kernels (elementwise, copies, reductions) are named by what made them (``aten::mul`` inside
    transformers' RMSNorm, ``aten::cat`` of its RoPE, ...)."""
    ops = [
        OpTime(e.key, e.count / calls, e.self_device_time_total / calls / 1e3)
        for e in prof.key_averages()
        if e.device_type.name == "CPU" and e.self_device_time_total > 0
    ]
    ops.sort(key=lambda o: o.ms, reverse=True)
    return ops


# CUDA runtime and driver API calls as the profiler names them on the host (cudaLaunchKernel, cuLaunchKernelEx,
# cudaStreamSynchronize, cudaMalloc, ...): a capital letter after the prefix tells them from ops such as "cudnn_..."
_RUNTIME_CALL = re.compile(r"^cu(da)?[A-Z]")


def host_calls(prof, calls: int) -> list[OpTime]:
    """Host time per call of the profiled work spent inside CUDA runtime and driver API calls, by call, most time
    first (``OpTime.ms`` is then *host* ms: the profiler's self CPU time of the call). A synchronisation or an
    allocation (cudaMalloc, cudaFree wait for the device) shows here as host time the step's launches waited on."""
    out = [
        OpTime(e.key, e.count / calls, e.self_cpu_time_total / calls / 1e3)
        for e in prof.key_averages()
        if e.device_type.name == "CPU" and _RUNTIME_CALL.match(e.key) and e.self_cpu_time_total > 0
    ]
    out.sort(key=lambda o: o.ms, reverse=True)
    return out


def dequant_vs_copy(
    shape: tuple[int, int], *, dequant=dequantize_nf4, rounds: int = 7, reps: int = 20
) -> tuple[PairedEstimate, int]:
    """Per-round bandwidth(dequant) / bandwidth(copy of the same bytes), and the bytes moved."""
    q = quantize_nf4((torch.randn(*shape, device="cuda") * 0.02).to(DT))
    out = torch.empty(shape, dtype=DT, device="cuda")
    moved = q.nbytes() + out.numel() * out.element_size()
    src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = interleaved_rounds(
        {"dequant": lambda: dequant(q, out=out), "copy": lambda: dst.copy_(src)}, rounds=rounds, reps=reps
    )
    return PairedEstimate.of([c / d for d, c in zip(ms["dequant"], ms["copy"])]), moved
