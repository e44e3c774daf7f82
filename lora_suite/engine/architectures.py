"""Tiny random-initialised models of the architecture families people fine-tune, built offline from transformers'
config classes (no checkpoint, no network): Llama, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), Gemma 2 (tied embeddings,
attention and final-logit soft-capping), Mistral, Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``) and Qwen3-MoE (a
dense first layer, then experts held as 3-D parameters, as transformers 5 holds them: ``experts.gate_up_proj``
(E, 2·I, K) and ``experts.down_proj`` (E, K, I)).

Each ``Architecture`` names its LoRA targets (the leaf names of its linears; for the MoE, its expert parameters
apart, in ``parameter_targets``: what PEFT's ``target_parameters`` adapts), which projections carry a bias, and whether
its embeddings are tied. ``build`` makes one in a few hundredths of a second on a CPU, deterministic from ``seed``, in
any dtype on any device, with every tensor drawn from the seed (transformers' own init would leave biases at zero:
then a dropped bias would change nothing):

    linear and expert weights   N(0, 1/fan_in)      (unit-variance activations stay unit-variance)
    embeddings                  N(0, 1)
    biases                      N(0, 0.5²)           (Qwen2's trained q/k biases are of this order or larger)
    norm weights                1 + N(0, 0.1²)       (Gemma's (1 + w) norms: N(0, 0.1²), a scale near 1 too)

Dropout is 0 everywhere and attention is the eager implementation (the one that soft-caps Gemma 2's scores).
Tied embeddings stay one tensor (``lm_head.weight is embed_tokens.weight``): init draws each parameter once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lora_suite.settings.config import LlamaArchitecture

if TYPE_CHECKING:  # torch is imported where a model is built: the scorecard reads only the names
    import torch
    from torch import nn

LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The CPU tests' model: a Llama of a few hundred thousand parameters (2 layers, hidden 64, vocab 300), and with other
# sizes the tiers' op-in-a-model checks (``lora_suite.engine.models.build_tiny_llama``); every family here is built at
# its widths
TINY_LLAMA = LlamaArchitecture(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
)
WIDTHS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
SIZES = {
    **{name: getattr(TINY_LLAMA, name) for name in (*WIDTHS, "vocab_size")},
    "max_position_embeddings": 256,
    "attn_implementation": "eager",
}
BIAS_STD, NORM_STD = 0.5, 0.1  # the module docstring says why


@dataclass(frozen=True)
class Architecture:
    """One family: its name (the prefix of its checks), transformers' config and model class names, the config's
    own fields beyond ``SIZES``, its LoRA targets, its expert parameters, the projections with a bias, tying."""

    name: str
    config_class: str
    model_class: str
    targets: tuple[str, ...]
    biased: tuple[str, ...] = ()
    tied: bool = False
    parameter_targets: tuple[str, ...] = ()  # 3-D expert parameters (leaf names), adapted through PEFT's
    extra: dict = field(default_factory=dict)  # target_parameters where a stack can

    def config(self):
        import transformers

        return getattr(transformers, self.config_class)(**SIZES, **self.extra)

    def build(self, dtype: torch.dtype, device, *, seed: int = 0) -> nn.Module:
        """The model, random-initialised from ``seed`` (module docstring), in ``dtype`` on ``device``, eval mode."""
        import torch
        import transformers

        with torch.device(device), default_dtype(dtype):
            model = getattr(transformers, self.model_class)(self.config())
        init_from_seed(model, seed)
        if self.tied and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            raise AssertionError(f"{self.name}: tie_word_embeddings is set but lm_head holds its own weight")
        return model.eval()

    def features(self) -> tuple[str, ...]:
        """The contract's FEATURES this family needs of a stack (lora_suite.implementations.contract)."""
        out = ["linear_bias"] if self.biased else []
        out += ["fused_projections"] if set(self.targets) - set(LLAMA_LINEARS) else []
        out += ["gated_gelu_mlp"] if "gelu" in str(getattr(self.config(), "hidden_activation", "") or "") else []
        return tuple(out + (["moe_experts"] if self.parameter_targets else []))


def init_from_seed(model: nn.Module, seed: int) -> None:
    """Every parameter drawn from ``seed`` in ``named_parameters`` order (a tied tensor once), module docstring's
    laws; drawn in fp32 on the CPU and then cast, so that every dtype and device holds the same values."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            draw = torch.randn(p.shape, generator=gen)
            if name.endswith(".bias"):
                value = BIAS_STD * draw
            elif p.dim() == 1:
                value = (0.0 if "gemma" in type(model).__name__.lower() else 1.0) + NORM_STD * draw
            elif "embed_tokens" in name:
                value = draw
            else:
                value = draw * p.shape[-1] ** -0.5
            p.copy_(value.to(p.dtype))


ATTN = LLAMA_LINEARS[:4]
ARCHITECTURES = {
    a.name: a
    for a in (
        Architecture("llama", "LlamaConfig", "LlamaForCausalLM", LLAMA_LINEARS),
        Architecture("qwen2", "Qwen2Config", "Qwen2ForCausalLM", LLAMA_LINEARS, biased=("q_proj", "k_proj", "v_proj")),
        Architecture("qwen3", "Qwen3Config", "Qwen3ForCausalLM", LLAMA_LINEARS, extra={"head_dim": 16}),
        Architecture(
            "gemma2",
            "Gemma2Config",
            "Gemma2ForCausalLM",
            LLAMA_LINEARS,
            tied=True,
            # soft caps low enough to bend these unit-scale logits and scores (Gemma 2 ships 30 and 50)
            extra={"head_dim": 16, "final_logit_softcapping": 5.0, "attn_logit_softcapping": 5.0},
        ),
        Architecture("mistral", "MistralConfig", "MistralForCausalLM", LLAMA_LINEARS, extra={"sliding_window": 8}),
        Architecture(
            "phi3",
            "Phi3Config",
            "Phi3ForCausalLM",
            ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
            extra={"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
        ),
        Architecture(
            "qwen3_moe",
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            ATTN,  # the linears every stack adapts; the experts' own adaptation: parameter_targets
            parameter_targets=("gate_up_proj", "down_proj"),
            extra={
                "experts_implementation": "eager",  # grouped_mm takes no float64 (the reference's dtype)
                "head_dim": 16,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "mlp_only_layers": [0],
            },
        ),
    )
}
NAMES = tuple(ARCHITECTURES)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to ``dtype`` inside the block (the models are built in it), restored after."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
