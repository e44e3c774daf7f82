"""Build the model a tier trains: a real checkpoint from local files, or the same architecture, random.

Weights modes: ``pretrained`` loads the checkpoint from ``local_path`` or the local Hugging Face cache
(offline, never the network) and raises ``CheckpointNotFound`` with the download command when absent;
``random`` builds the architecture with random initialisation; ``auto`` tries ``pretrained`` and falls
back to ``random`` (saying so in ``BuiltModel.weights``, which every report prints).

Random initialisation is done here, not by transformers: the model is created on the ``meta`` device,
then each piece is materialised directly on the target device in the training dtype and initialised as
Llama is (Linear and Embedding N(0, 0.02²), RMSNorm weight 1; a bias, where the family has one, N(0, 0.5²)). The
family (``LlamaArchitecture.family``) picks transformers' classes: Llama, Qwen2 (q, k and v with a bias), Gemma 2, or
Qwen3-MoE (every MLP a set of experts; the router's weight and the experts' 3-D parameters N(0, 0.02²) too).
Pieces are materialised one decoder layer at a time and handed to ``on_layer`` before the next, so a caller can
quantise or wrap each layer while at most one 16-bit layer exists (a 7B model never exists in 16 bits as a whole).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from lora_suite.engine.architectures import BIAS_STD, TINY_LLAMA, default_dtype
from lora_suite.settings.config import LlamaArchitecture, ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

INIT_STD = 0.02  # Llama's initializer_range


class CheckpointNotFound(FileNotFoundError):
    """``weights: pretrained`` but no local checkpoint; the message gives the command that fetches it."""


@dataclass
class BuiltModel:
    model: nn.Module
    tokenizer: PreTrainedTokenizerBase | None  # a transformers tokenizer when the checkpoint has one, else None
    weights: str  # "pretrained" or "random" (what was actually built)
    source: str  # where the weights came from, in words
    build_seconds: float


def _family(arch: LlamaArchitecture):
    """(config class, causal-LM class, rotary-embedding class) of the architecture's family."""
    if arch.family == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM
        from transformers.models.gemma2.modeling_gemma2 import Gemma2RotaryEmbedding

        return Gemma2Config, Gemma2ForCausalLM, Gemma2RotaryEmbedding
    if arch.family == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

        return Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3MoeRotaryEmbedding
    if arch.family == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

        return Qwen2Config, Qwen2ForCausalLM, Qwen2RotaryEmbedding
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaConfig, LlamaForCausalLM, LlamaRotaryEmbedding


def hf_config(arch: LlamaArchitecture):
    # a mixture-of-experts family: every layer sparse; transformers' eager expert loop, the computation every stack's
    # expert adapter is judged against (PEFT's ParamWrapper keeps the module's own forward)
    moe = (
        dict(
            num_experts=arch.num_experts,
            num_experts_per_tok=arch.num_experts_per_tok,
            moe_intermediate_size=arch.moe_intermediate_size,
            mlp_only_layers=[],
            experts_implementation="eager",
        )
        if arch.num_experts
        else {}
    )
    return _family(arch)[0](
        **moe,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        vocab_size=arch.vocab_size,
        tie_word_embeddings=arch.tie_word_embeddings,
        rope_theta=arch.rope_theta,
        max_position_embeddings=arch.max_position_embeddings,
        rms_norm_eps=arch.rms_norm_eps,
        initializer_range=INIT_STD,
        # Gemma 2 soft-caps its attention scores, which only transformers' eager attention computes
        attn_implementation="eager" if arch.family == "gemma2" else "sdpa",
        head_dim=arch.head_dim,  # Gemma2Config's own default (256) is not hidden / heads
    )


def find_local_checkpoint(cfg: ModelConfig) -> Path | None:
    """``local_path`` if it holds a config.json, else the local HF cache snapshot of ``checkpoint``."""
    if cfg.local_path:
        path = Path(cfg.local_path).expanduser()
        return path if (path / "config.json").exists() else None
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        path = Path(snapshot_download(cfg.checkpoint, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    return path if (path / "config.json").exists() else None


def download_command(cfg: ModelConfig) -> str:
    return f"hf download {cfg.checkpoint}   # or: huggingface-cli download {cfg.checkpoint}"


def build_model(
    cfg: ModelConfig,
    weights: str,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    seed: int = 0,
    on_layer: Callable[[nn.Module], None] | None = None,
) -> BuiltModel:
    """Build per ``weights`` (auto | pretrained | random); see the module docstring."""
    if weights not in ("auto", "pretrained", "random"):
        raise ValueError(f"weights={weights!r} is not one of auto, pretrained, random")
    start = time.perf_counter()
    if weights in ("auto", "pretrained"):
        path = find_local_checkpoint(cfg)
        if path is None and cfg.local_path and weights == "auto":  # asked for by name: never a silent random model
            raise ValueError(
                f"model {cfg.name}: local_path {cfg.local_path} holds no config.json (expected a Hugging Face "
                "checkpoint folder: config.json and the weights); fix the path, or set local_path: null to build "
                "the random-initialised architecture"
            )
        if path is not None:
            model, tokenizer = _load_pretrained(cfg, path, dtype, device, on_layer)
            return BuiltModel(model, tokenizer, "pretrained", f"checkpoint {path}", time.perf_counter() - start)
        if weights == "pretrained":
            where = f"local_path {cfg.local_path}" if cfg.local_path else f"the local HF cache ({cfg.checkpoint})"
            raise CheckpointNotFound(
                f"weights: pretrained, but no checkpoint of {cfg.name} in {where}; "
                f"fetch it with: {download_command(cfg)}"
            )
    model = build_random(cfg.architecture, dtype, device, seed=seed, on_layer=on_layer)
    note = "" if weights == "random" else " (auto: no local checkpoint found)"
    return BuiltModel(
        model,
        None,
        "random",
        f"random init (seed {seed}) of the {cfg.name} architecture{note}",
        time.perf_counter() - start,
    )


def build_random(
    arch: LlamaArchitecture,
    dtype: torch.dtype,
    device,
    *,
    seed: int = 0,
    on_layer: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    _, model_class, rotary_class = _family(arch)
    device = torch.device(device)
    config = hf_config(arch)
    with torch.device("meta"), default_dtype(dtype):
        model = model_class(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    pieces = [model.model.embed_tokens, model.model.norm] + ([] if arch.tie_word_embeddings else [model.lm_head])
    for piece in pieces:
        _materialise(piece, device, gen, config)
    for layer in model.model.layers:
        _materialise(layer, device, gen, config)  # its buffers set before on_layer adds its own (an NF4 base's)
        if on_layer is not None:
            on_layer(layer)
    with torch.device(device):  # inv_freq is computed in __init__: build it where it will live, in fp32
        model.model.rotary_emb = rotary_class(config=config)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    leftovers = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not leftovers, f"not materialised: {leftovers[:5]}"
    return model.eval()


# Buffers that ``to_empty`` leaves uninitialised, by leaf name -> their value from the config (the rotary embedding's
# are rebuilt whole). Gemma's embedding scales its rows by √hidden: left empty, it scaled them by whatever the memory
# held (3.8e-311 on a CPU: every logit 0; NaN gradients on an H100).
_BUFFER_VALUES = {"embed_scale": lambda config: config.hidden_size**0.5}


@torch.no_grad()
def _fill_buffers(module: nn.Module, config) -> None:
    """Every buffer of a piece ``to_empty`` just materialised set from ``_BUFFER_VALUES``; one without a rule is
    refused by name (a family with a buffer this builder does not know would otherwise compute with uninitialised
    memory). The rotary embedding is not materialised but built whole, where it lives."""
    for name, buf in module.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in _BUFFER_VALUES:
            raise AssertionError(f"build_random: buffer {name!r} has no value rule (lora_suite/engine/models.py)")
        buf.fill_(_BUFFER_VALUES[leaf](config))


def build_tiny_llama(
    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *, seed: int = 0, **sizes: int
) -> nn.Module:
    """``build_random`` of ``TINY_LLAMA`` with ``sizes`` (``LlamaArchitecture`` fields: ``hidden_size=256``...) in
    place of its own: the one builder of the small models that tests and op-in-a-model checks need."""
    # sizes are LlamaArchitecture's int fields; mypy checks a **dict[str, int] against every field (bool, str too)
    arch = dataclasses.replace(TINY_LLAMA, **sizes)  # type: ignore[arg-type]  # sizes name int fields; mypy checks every field
    return build_random(arch, dtype, device, seed=seed)


@torch.no_grad()
def _materialise(module: nn.Module, device: torch.device, gen: torch.Generator, config) -> None:
    module.to_empty(device=device)
    _fill_buffers(module, config)
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            sub.weight.normal_(0.0, INIT_STD, generator=gen)
            bias = getattr(sub, "bias", None)  # an Embedding has none, a Linear None or a tensor
            if bias is not None:
                bias.normal_(0.0, BIAS_STD, generator=gen)
        elif hasattr(sub, "weight") and isinstance(sub.weight, torch.Tensor) and sub.weight.dim() == 1:
            sub.weight.fill_(0.0 if "Gemma" in type(sub).__name__ else 1.0)  # RMSNorm: Gemma's scales by (1 + w)
    for sub in module.modules():  # after them (the dense families' draws unchanged): an MoE router's (E, H) weight and
        if not isinstance(sub, (nn.Linear, nn.Embedding)):  # the experts' 3-D parameters, N(0, 0.02²) as transformers
            for p in sub.parameters(recurse=False):
                if p.dim() >= 2:
                    p.normal_(0.0, INIT_STD, generator=gen)


def _load_pretrained(cfg: ModelConfig, path: Path, dtype, device, on_layer):
    from transformers import AutoTokenizer

    # With a per-layer hook, load into host memory and move one decoder layer at a time, so that the hook
    # (NF4 quantisation) runs before the next 16-bit layer reaches the GPU.
    target = torch.device(device)
    model = _family(cfg.architecture)[1].from_pretrained(
        path, dtype=dtype, device_map="cpu" if on_layer else str(target), local_files_only=True
    )
    got, want = model.config, cfg.architecture
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    ):
        if getattr(got, key) != getattr(want, key):
            raise ValueError(
                f"checkpoint {path} has {key}={getattr(got, key)}, but configs/models/{cfg.name}.yaml "
                f"says {getattr(want, key)}"
            )
    if on_layer is not None:
        for piece in (model.model.embed_tokens, model.model.norm, model.model.rotary_emb, model.lm_head):
            piece.to(target)
        for layer in model.model.layers:
            layer.to(target)
            on_layer(layer)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        tokenizer = None  # weights without tokenizer files: the byte-level tokenizer is used
    return model.eval(), tokenizer
