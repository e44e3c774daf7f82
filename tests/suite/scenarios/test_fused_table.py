"""The fused table's kernel kinds (lora_suite.scenarios.fused_table.kernel_kind): each profiled kernel name lands in
the kind that owns it, so a profile's shares say which code spends the time."""

from __future__ import annotations

import pytest

from lora_suite.scenarios import fused_table as FT
from lora_suite.scenarios.fused_table import kernel_kind


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        (
            "void swiglu_backward_inplace<__nv_bfloat16, 8>(__nv_bfloat16*, __nv_bfloat16*, long long, long long)",
            "LoRA SwiGLU",
        ),
        ("void swiglu_forward<float, 1>(float const*, float*, long long, long long)", "LoRA SwiGLU"),
        ("_swiglu_forward_kernel", "Liger"),  # Liger's Triton kernels, measured on an H100 as "LoRA SwiGLU" before
        ("_swiglu_backward_kernel", "Liger"),
        ("void nf4_dequantize<__nv_bfloat16>(unsigned int const*, float const*, signed char const*)", "NF4"),
        ("void cast_stack_from_f32<__half>(float const*)", "adapter casts"),
        ("nvjet_sm90_tst_128x128_64x6_2x1_v_bz_NNT", "GEMM"),
        ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>", "other"),
    ],
)
def test_a_kernel_lands_in_the_kind_that_owns_it(name, kind):
    assert kernel_kind(name).startswith(kind)


def test_an_isolated_stacks_child_output_is_read_or_its_failure_named():
    import dataclasses
    import json

    fig = FT.EagerFigures(1.0, 2.0, 3.5, 4.25, "unsloth", "none")
    out = "Unsloth: patching\n" + FT.CHILD_MARK + json.dumps(dataclasses.asdict(fig)) + "\n"
    assert FT.parse_child_output(0, out, "", "unsloth") == fig
    with pytest.raises(RuntimeError, match="exited 1 without figures: .*CUDA out of memory"):
        FT.parse_child_output(1, "", "Traceback\ntorch.OutOfMemoryError: CUDA out of memory", "unsloth")
    with pytest.raises(RuntimeError, match="exited 0 without figures"):
        FT.parse_child_output(0, "no mark here", "", "unsloth")
    assert FT.ISOLATED <= set(FT.STACKS)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_the_profiled_step_is_checkpointed_when_its_case_is(checkpointed, monkeypatch):
    """The full tier's case is checkpointed; its profile was once taken without checkpointing (no recompute in
    the kernels it summed), while its timed runs had it. ``profile_steps`` must profile the step it reports on."""
    import contextlib
    import types

    import torch

    from lora_suite.engine import benchmarking

    enabled = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def gradient_checkpointing_enable(self, **kwargs):
            enabled.append(kwargs)

        def forward(self, input_ids, labels):
            return types.SimpleNamespace(loss=(self.w * input_ids.float()).sum())

    model = Model()
    prepared = types.SimpleNamespace(
        model=model,
        adapters={"w": model.w},
        batches=lambda i: {"input_ids": torch.ones(2, 3), "labels": torch.ones(2, 3)},
    )
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(lr=1e-3, gradient_checkpointing=checkpointed))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.profiler, "profile", lambda **kw: contextlib.nullcontext())
    monkeypatch.setattr(benchmarking, "kernel_profile", lambda prof, steps: (1.0, []))
    monkeypatch.setattr(benchmarking, "op_profile", lambda prof, steps: [])
    FT.profile_steps(prepared, cfg)
    assert enabled == ([{"gradient_checkpointing_kwargs": {"use_reentrant": False}}] if checkpointed else [])
