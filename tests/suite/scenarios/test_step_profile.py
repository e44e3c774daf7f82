"""The kernel profiles of the fused table (lora_suite.scenarios.step_profile) on the CPU: each profiled kernel name
lands in the kind that owns it (lora_core's CUDA, Unsloth's and Liger's Triton, Inductor's, cuBLAS), so a profile's
shares say which code spends the time; the profiled step is the step whose time is reported and its span is timed;
a profile survives its trip through a child's JSON."""

from __future__ import annotations

import contextlib
import json
import types

import pytest
import torch

from lora_suite.engine import benchmarking
from lora_suite.engine.benchmarking import KernelTime, OpTime
from lora_suite.scenarios import step_profile as SP
from lora_suite.scenarios.step_profile import kernel_kind

LORA_CORE = [
    (
        "void swiglu_backward_inplace<__nv_bfloat16, 8>(__nv_bfloat16*, __nv_bfloat16*, long long, long long)",
        "LoRA SwiGLU",
    ),
    ("void swiglu_forward<float, 1>(float const*, float*, long long, long long)", "LoRA SwiGLU"),
    ("void nf4_dequantize<__nv_bfloat16>(unsigned int const*, float const*, signed char const*)", "NF4"),
    ("void cast_stack_from_f32<__half>(float const*)", "adapter casts"),
    ("void cast_pair_from_f32<__nv_bfloat16>(float const*, float const*)", "adapter casts"),
]
# Liger's kernels (liger_kernel/ops/*.py): their kind must not move to Unsloth's, whose names are inside some of them
LIGER = [
    "_swiglu_forward_kernel",  # measured on an H100 as "LoRA SwiGLU" before the template bracket
    "_swiglu_backward_kernel",
    "_rms_norm_forward_kernel",
    "_rms_norm_backward_kernel",
    "_triton_rope",
    "_triton_rope_bsnd_qk",
    "liger_cross_entropy_kernel",
    "liger_cross_entropy_forward_kernel",  # holds Unsloth's _cross_entropy_forward
    "liger_cross_entropy_backward_kernel",
    "_geglu_tanh_forward_kernel",
]
# Unsloth's (unsloth/kernels/*.py, the functions under @triton.jit that it launches)
UNSLOTH = [
    "_rms_layernorm_forward",
    "_rms_layernorm_backward",
    "_rms_layernorm_forward_rows",
    "_gemma_rms_layernorm_forward",
    "_rope_embedding_QK",  # holds Liger's "_rope"
    "_fg_kernel",
    "_DWf_DW_dfg_kernel",
    "_cross_entropy_forward",  # holds Liger's "cross_entropy"
    "_cross_entropy_backward",
    "_chunked_cross_entropy_forward",
    "_exact_forward_kernel",
    "_approx_backward_kernel",
    "_nf4_dequant_kernel",
    "_rms_layernorm_forward_0d1d2d3d4d5d6d7de8de",  # Triton 2's names carry the specialisation after the function's
]


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        *LORA_CORE,
        *[(n, "Liger (Triton)") for n in LIGER],
        *[(n, "Unsloth (Triton)") for n in UNSLOTH],
        ("triton_red_fused__log_softmax_nll_loss_forward_0", "torch.compile (Inductor Triton)"),
        ("triton_poi_fused_add_mul_rms_norm_1", "torch.compile (Inductor Triton)"),
        ("nvjet_sm90_tst_128x128_64x6_2x1_v_bz_NNT", "GEMM"),
        ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false>>(Flash_fwd_params)", "attention"),
        ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>", "other"),
        # an anchored key matches only at the start: a name holding an Unsloth function's name elsewhere is not its
        ("void at::native::my_fg_kernel_helper<float>()", "other"),
        # lora_core's own kernels, the fused loss's not taken by Liger's "cross_entropy" key
        (
            "void cross_entropy_rows<__nv_bfloat16, 8>(__nv_bfloat16*, long long const*, float*, long long)",
            "LoRA fused",
        ),
        (
            "void geglu_backward_inplace<__nv_bfloat16, 8>(__nv_bfloat16*, __nv_bfloat16*, long long)",
            "LoRA SwiGLU/GeGLU",
        ),
        ("liger_cross_entropy_kernel", "Liger"),
    ],
)
def test_a_kernel_lands_in_the_kind_that_owns_it(name, kind):
    assert kernel_kind(name).startswith(kind)


def test_every_kind_is_named_once_and_the_unsloth_kind_comes_before_liger_and_gemm():
    kinds = [k for k, _ in SP.KERNEL_KINDS]
    assert len(kinds) == len(set(kinds))
    assert kinds.index("Unsloth (Triton)") < kinds.index("Liger (Triton)") < kinds.index("GEMM (cuBLAS)")
    assert kinds.index("LoRA fused loss (cross_entropy.cu)") < kinds.index("Liger (Triton)")
    assert all(key == key.lower() for _, keys in SP.KERNEL_KINDS for key in keys)  # names are lower-cased first


def _profile(n_kernels: int = 3, n_ops: int = 2) -> SP.StepProfile:
    kernels = [KernelTime(f"kernel<{i}>", 2.0 * i + 1, 10.0 - 0.5 * i) for i in range(n_kernels)]
    ops = [OpTime(f"aten::op{i}", 3.0, 4.0 - 0.1 * i) for i in range(n_ops)]
    kinds = {SP.OTHER_KIND: sum(k.ms for k in kernels)}
    host = tuple(OpTime(f"cudaCall{i}", 2.0, 1.0 - 0.01 * i) for i in range(n_ops))
    return SP.StepProfile(sum(k.ms for k in kernels), kinds, kernels, ops, 120.5, 131.0, host)


def test_a_profile_survives_its_trip_through_json_with_its_top_kernels_and_ops():
    small = _profile()
    assert SP.profile_from_json(json.loads(json.dumps(SP.profile_to_json(small)))) == small
    big = _profile(n_kernels=SP.TOP_KERNELS + 5, n_ops=SP.TOP_OPS + 3)
    back = SP.profile_from_json(json.loads(json.dumps(SP.profile_to_json(big))))
    assert back.kernels == big.kernels[: SP.TOP_KERNELS] and back.ops == big.ops[: SP.TOP_OPS]
    assert back.host == big.host[: SP.TOP_OPS] and len(big.host) > SP.TOP_OPS
    assert (back.total_ms, back.kinds, back.span_ms, back.profiled_span_ms) == (big.total_ms, big.kinds, 120.5, 131.0)
    assert isinstance(back.kernels[0], KernelTime) and isinstance(back.ops[0], OpTime)


def test_a_profile_not_of_its_shape_is_refused_naming_what_is_wrong():
    data = SP.profile_to_json(_profile())
    del data["span_ms"]
    with pytest.raises(ValueError, match=r"fields .*'span_ms'.*got \[.*'profiled_span_ms', 'total_ms'\]"):
        SP.profile_from_json(data)
    data = SP.profile_to_json(_profile())
    data["kernels"][0] = {"name": "k", "ms": 1.0}
    with pytest.raises(ValueError, match="not of its shape \\(KeyError: 'launches'\\)"):
        SP.profile_from_json(data)


def test_the_host_bound_gap_is_the_share_of_the_step_without_kernels():
    prof = _profile()._replace(total_ms=30.0, span_ms=120.0)
    assert SP.gap_share(prof) == pytest.approx(0.75)
    assert SP.gap_share(prof._replace(span_ms=0.0)) is None


class _Clock:
    """A stand-in for CUDA events: time passes in the model's forward, by ``cost`` ms (more under the profiler)."""

    def __init__(self):
        self.now, self.cost = 0.0, 7.0

    def event(self, enable_timing=False):
        clock = self

        class Event:
            def record(self):
                self.t = clock.now

            def elapsed_time(self, other):
                return other.t - self.t

        return Event()

    @contextlib.contextmanager
    def profile(self, **kwargs):
        self.cost = 9.0
        yield "profile"
        self.cost = 7.0


def _fake_step(checkpointed, clock, enabled):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def gradient_checkpointing_enable(self, **kwargs):
            enabled.append(kwargs)

        def forward(self, input_ids, labels):
            clock.now += clock.cost
            return types.SimpleNamespace(loss=(self.w * input_ids.float()).sum())

    model = Model()
    prepared = types.SimpleNamespace(
        model=model,
        adapters={"w": model.w},
        batches=lambda i: {"input_ids": torch.ones(2, 3), "labels": torch.ones(2, 3)},
    )
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(lr=1e-3, gradient_checkpointing=checkpointed))
    return prepared, cfg


@pytest.mark.parametrize("checkpointed", [False, True])
def test_the_profiled_step_is_checkpointed_when_its_case_is_and_its_span_timed(checkpointed, monkeypatch):
    """The full tier's case is checkpointed; its profile was once taken without checkpointing (no recompute in
    the kernels it summed), while its timed runs had it. ``profile_steps`` must profile the step it reports on,
    and time it apart from the profile (``span_ms``) and under it (``profiled_span_ms``)."""
    enabled, clock = [], _Clock()
    prepared, cfg = _fake_step(checkpointed, clock, enabled)
    kernels = [
        KernelTime("_fg_kernel", 2.0, 3.0),
        KernelTime("nvjet_x", 4.0, 2.5),
        KernelTime("_DWf_DW_dfg_kernel", 1, 1),
    ]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    monkeypatch.setattr(torch.profiler, "profile", clock.profile)
    monkeypatch.setattr(benchmarking, "kernel_profile", lambda prof, steps: (6.5, kernels))
    monkeypatch.setattr(benchmarking, "op_profile", lambda prof, steps: [OpTime("aten::mm", 1.0, 2.5)])
    monkeypatch.setattr(benchmarking, "host_calls", lambda prof, steps: [OpTime("cudaMalloc", 2.0, 3.5)])
    prof = SP.profile_steps(prepared, cfg)
    assert enabled == ([{"gradient_checkpointing_kwargs": {"use_reentrant": False}}] if checkpointed else [])
    assert (prof.span_ms, prof.profiled_span_ms, prof.total_ms) == (7.0, 9.0, 6.5)
    assert prof.kinds == {"Unsloth (Triton)": 4.0, "GEMM (cuBLAS)": 2.5}
    assert prof.ops == [OpTime("aten::mm", 1.0, 2.5)]
    assert prof.host == (OpTime("cudaMalloc", 2.0, 3.5),)


def _timed(kernel_ms: float, span_ms: float) -> SP.StepProfile:
    return SP.StepProfile(kernel_ms, {}, [], [], span_ms, span_ms)


def test_kernel_time_against_reads_the_gpu_work_apart_from_a_host_bound_step():
    # the stack's GPU work is 1.1x faster, but its step waits on its host: its eager step is the slower
    row = SP.kernel_time_against(_timed(100.0, 160.0), _timed(110.0, 125.0), 1.2)
    assert row[:4] == (1.1, 0.781, 0.375, 0.12)
    assert (
        row[4]
        == "host-bound (stack and against): the eager ratio is partly the host's; kernel time below the 1.2x target"
    )
    row = SP.kernel_time_against(_timed(100.0, 104.0), _timed(125.0, 130.0), 1.2)
    assert row[0] == 1.25 and row[4] == "GPU-bound; kernel time reaches the 1.2x target"
    assert SP.kernel_time_against(_timed(0.0, 0.0), _timed(1.0, 1.0), 1.2)[0] is None
