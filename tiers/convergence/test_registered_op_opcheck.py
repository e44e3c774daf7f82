"""The registered op (``torch.ops.lora_core.lora_linear``) passes ``torch.library.opcheck`` on the GPU: schema,
autograd registration, fake-tensor and AOT-dispatch checks, with the CUDA (cupy) implementation running.

In the convergence tier with the other compile checks (moved from the quick tier, issue 20: its AOT-autograd pass
is the first use of torch's compiler stack, 3.2-3.5 s of the quick tier's 30 s budget on an H200).
"""

from __future__ import annotations

import pytest
import torch

import lora_core
from lora_suite.parity import random_case

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
