"""The registered op (``torch.ops.lora_core.lora_linear``) on the GPU: it passes ``torch.library.opcheck``
(schema, autograd registration, fake-tensor and AOT-dispatch checks) with the CUDA (cupy) implementation running,
and it computes y, dx, dA, dB bitwise as the autograd Function does.

In the convergence tier with the other compile checks (moved from the quick tier, issue 20: the registered op's
first call imports torch's compiler stack, 3.2-5.5 s of the quick tier's 30 s budget on an H200).
"""

from __future__ import annotations

import pytest
import torch

import lora_core
from lora_core.ops.registered import lora_linear_op
from lora_suite.judges.parity import random_case

pytestmark = [pytest.mark.gpu, pytest.mark.convergence, pytest.mark.needs_feature("lora_core_ops")]

DEV = "cuda"
F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("dtype,adapter_dtype", [(F32, F32), (BF16, F32), (BF16, BF16)])
def test_registered_op_passes_opcheck_on_cuda(dtype, adapter_dtype):
    x, w, a, b, _ = random_case((3, 40), 96, 80, 8, dtype, adapter_dtype, DEV)
    a.requires_grad_(), b.requires_grad_()  # opcheck then also checks the autograd registration
    before = lora_core.backend_call_counts()["cupy"]
    torch.library.opcheck(torch.ops.lora_core.lora_linear.default, (x, w.detach(), a, b, 1.5))
    assert lora_core.backend_call_counts()["cupy"] > before, "the CUDA implementation (cupy path) did not run"


def test_registered_op_on_cuda_equals_the_autograd_function_bitwise():
    x, w, a, b, dy = random_case((512,), 1024, 768, 16, BF16, F32, DEV)
    a.requires_grad_(), b.requires_grad_()
    results = []
    for fn in (lambda: lora_core.lora_linear(x, w, a, b, 2.0, backend="cupy"), lambda: lora_linear_op(x, w, a, b, 2.0)):
        for t in (x, a, b):
            t.grad = None
        y = fn()
        y.backward(dy)
        results.append((y.detach(), x.grad, a.grad, b.grad))
    for name, u, v in zip(("y", "dx", "dA", "dB"), *results):
        assert torch.equal(u, v), f"{name}: op and Function differ by {(u.float() - v.float()).abs().max()}"
