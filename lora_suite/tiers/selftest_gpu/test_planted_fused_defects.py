"""selftest-gpu, the fused LoRA paths: each test plants one defect in ``lora_core.ops.fused_mlp`` or ``fused_qkv``
(a monkeypatch here, never in shipped code) and asserts that the quick tier's fused parity criterion
(``tiers/quick/test_fused_parity.py``) fails on it, recording by how much."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_suite.harness.modules import load_test_module

pytestmark = [pytest.mark.gpu, pytest.mark.selftest_gpu]
PARITY = Path(__file__).resolve().parents[1] / "quick" / "test_fused_parity.py"


def _parity_module():
    return load_test_module(PARITY, "fused_parity_plant")


def _fused_parity_failures(what: str) -> tuple[int, str]:
    """Tensors beyond tolerance in one bf16 case of the quick tier's fused parity test (test_fused_parity.py):
    ``what`` is "mlp" (SwiGLU), "geglu" (the MLP with Gemma's tanh-GELU gate), "mlp_bias" (biases on gate, up and
    down), "qkv" or "qkv_bias" (Qwen2's q/k/v biases); biases drawn as the quick grid draws them."""
    fp = _parity_module()
    gen = torch.Generator(device="cuda").manual_seed(2031)
    if what in ("mlp", "geglu", "mlp_bias"):
        act = "gelu_tanh" if what == "geglu" else "silu"
        x, weights, adapters, dy = fp._mlp_case(512, 576, 1536, 16, torch.bfloat16, torch.float32, "3d", gen)
        bias = (
            None
            if what != "mlp_bias"
            else (fp._randn((3072,), torch.bfloat16, gen), fp._randn((576,), torch.bfloat16, gen))
        )
        got = fp._mlp_fused(x, weights, adapters, dy, activation=act, bias=bias)
        ref = fp._mlp_reference(x, weights, adapters, dy, activation=act, bias=bias)
        names, k, floors = fp.MLP_NAMES, 1536, fp._mlp_floors(x, weights, adapters, dy, act, bias)
    else:
        sizes = (576, 192, 192)
        x, weights, adapters, dy = fp._qkv_case(512, 576, sizes, 16, torch.bfloat16, torch.float32, "3d", gen)
        bias = fp._randn((sum(sizes),), torch.bfloat16, gen) if what == "qkv_bias" else None
        got = fp._qkv_fused(x, weights, adapters, dy, bias=bias)
        ref = fp._qkv_reference(x, weights, adapters, dy, bias=bias)
        names, k, floors = fp.QKV_NAMES, 576, None
    errs = fp._judge(names, got[0] + got[1], ref[0] + ref[1], fp.FUSED_STAGES * fp.tolerance(torch.bfloat16, k), floors)
    bad = [e for e in errs if not e.ok]
    return len(bad), "; ".join(e.describe() for e in bad[:3])


def _check_caught(tier, what: str, name: str) -> None:
    """The check that the plant is caught: tensors of the ``what`` case (mlp or qkv) beyond tolerance, more than 0."""
    n_bad, detail = _fused_parity_failures(what)
    tier.check(name, n_bad, ">", 0, source="quick tier's fused parity test", detail=detail)


def _plant_gate_derivative(monkeypatch, wrong_derivative) -> None:
    """The fused MLP's gated backward with ``wrong_derivative(g)`` in place of f'(g): dg = d · u · wrong_derivative(g)."""
    from lora_core.ops import fused_mlp

    real = fused_mlp.swiglu_backward_

    def planted(eng, dact, gu, activation="silu"):
        inter = dact.shape[1]
        g, u, d = gu[:, :inter].float(), gu[:, inter:].float(), dact.float()
        real(eng, dact, gu, activation)
        gu[:, :inter].copy_(d * u * wrong_derivative(g))

    monkeypatch.setattr(fused_mlp, "swiglu_backward_", planted)


@pytest.mark.needs_feature("lora_core_ops")
def test_a_dropped_swiglu_derivative_term_is_caught(tier, monkeypatch):
    """The fused MLP's SwiGLU backward uses silu'(g) = σ(g), dropping the g·σ(1 - σ) term."""
    _plant_gate_derivative(monkeypatch, torch.sigmoid)
    _check_caught(tier, "mlp", "planted dropped silu' term: fused MLP tensors beyond tolerance")


@pytest.mark.needs_feature("lora_core_ops")
def test_dx_of_k_not_accumulated_is_caught(tier, monkeypatch):
    """The fused QKV backward leaves k's contribution dk·W_k out of dx."""
    from lora_core.ops import fused_qkv

    real, calls = fused_qkv.accumulate_dx, []

    def planted(eng, dx, d_part, w_part):
        calls.append(1)
        if len(calls) % 3 != 2:  # q, k, v in that order: skip k
            real(eng, dx, d_part, w_part)

    monkeypatch.setattr(fused_qkv, "accumulate_dx", planted)
    _check_caught(tier, "qkv", "planted dx missing dk·W_k: fused QKV tensors beyond tolerance")


@pytest.mark.needs_feature("lora_core_ops")
def test_a_geglu_derivative_without_its_density_term_is_caught(tier, monkeypatch):
    """The fused MLP's GeGLU backward uses gelu'(g) = Φ(g) (tanh form), dropping the g·Φ'(g) term."""
    _plant_gate_derivative(monkeypatch, lambda g: 0.5 * (1.0 + torch.tanh(0.7978845608028654 * (g + 0.044715 * g**3))))
    _check_caught(tier, "geglu", "planted GeGLU derivative without g·Φ'(g): fused MLP tensors beyond tolerance")


@pytest.mark.needs_feature("lora_core_ops")
@pytest.mark.parametrize("what", ["mlp", "qkv"])
def test_a_bias_overwritten_by_the_first_gemm_is_caught(what, tier, monkeypatch):
    """The fused path copies each bias into its output and then runs the first GEMM with β = 0, which overwrites
    it."""
    from lora_core.ops import fused_mlp, fused_qkv

    module = fused_mlp if what == "mlp" else fused_qkv
    real = module.bias_into_
    monkeypatch.setattr(module, "bias_into_", lambda out, bias, start=0: real(out, bias, start) * 0.0)
    _check_caught(tier, f"{what}_bias", f"planted bias overwritten: fused {what.upper()} tensors beyond tolerance")


LOSS_PARITY = Path(__file__).resolve().parents[1] / "quick" / "test_fused_loss_parity.py"


def _loss_parity_failures() -> tuple[int, str]:
    """Tensors beyond tolerance in one bf16 case of the quick tier's fused loss parity test (a trainable head, many
    chunks, a third of the tokens ignored)."""
    fp = load_test_module(LOSS_PARITY, "fused_loss_parity_plant")
    gen = torch.Generator(device="cuda").manual_seed(2034)
    h, w, t = fp.loss_case(2048, 576, 49152, torch.bfloat16, "3d", gen)
    got, want = fp.fused(h, w, t, True, 300), fp.reference(h, w, t, True)
    bad = [e for e in fp.judge(got, want, torch.bfloat16, 2048, 576, 49152) if not e.ok]
    return len(bad), "; ".join(e.describe() for e in bad[:3])


@pytest.mark.needs_feature("lora_core_ops")
def test_a_dropped_target_term_in_the_loss_gradient_is_caught(tier, monkeypatch):
    """The fused loss's dz keeps softmax(z) but drops the −[j = t] term at each labelled row's target."""
    from lora_core.ops import linear_cross_entropy as lce

    real = lce.ce_rows_

    def planted(eng, z, targets, loss_rows, ignore, softcap=0.0):
        real(eng, z, targets, loss_rows, ignore, softcap)
        rows = torch.arange(z.shape[0], device=z.device)
        kept = targets != ignore
        z[rows[kept], targets[kept]] += 1.0

    monkeypatch.setattr(lce, "ce_rows_", planted)
    n_bad, detail = _loss_parity_failures()
    tier.check("planted dropped -[j = t] term: fused loss tensors beyond tolerance", n_bad, ">", 0, detail=detail)


@pytest.mark.needs_feature("lora_core_ops")
def test_a_mean_over_ignored_tokens_too_is_caught(tier, monkeypatch):
    """The fused loss divides by every token, not by the labelled ones (ignored tokens counted in n)."""
    from lora_core.ops import linear_cross_entropy as lce

    real = lce._scale
    monkeypatch.setattr(lce, "_scale", lambda t, num_items, ignore, dtype: real(t, t.numel(), ignore, dtype))
    n_bad, detail = _loss_parity_failures()
    tier.check("planted mean over all tokens: fused loss tensors beyond tolerance", n_bad, ">", 0, detail=detail)
