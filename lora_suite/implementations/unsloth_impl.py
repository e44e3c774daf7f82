"""``unsloth``: Unsloth's LoRA stack judged as its users run it: the model read by ``FastLanguageModel.from_pretrained``,
adapters put in by ``FastLanguageModel.get_peft_model``, training through Unsloth's fused LoRA kernels
(``unsloth.kernels.fast_lora``) and its patched Llama forward.

Whole models. Unsloth trains only models its loader read: ``get_peft_model`` on a ``LlamaForCausalLM`` built in
memory fails (``AttributeError: 'LlamaForCausalLM' object has no attribute '_saved_temp_tokenizer'``). So
``load_model`` writes the model the suite built (its weights, its config and a tokenizer) to a temporary folder and
reads it back (the build hands each decoder layer to host memory as it is built: ``prepare`` does that for an
implementation with its own loader, so the model never sits on the GPU twice) with ``from_pretrained``: 16-bit (``load_in_16bit``) for a 16-bit base, ``load_in_4bit`` for an NF4
base (bitsandbytes nf4, block 64, double quant: the settings of ``peft-bnb``, so a comparison run quantised by
``quantize_base`` has the same codes). ``inject`` then calls ``get_peft_model`` with dropout 0 and no bias, the
settings under which Unsloth's ``patch_peft_model`` installs its kernels: each MLP's forward becomes
``apply_lora_mlp_swiglu`` and each attention gets ``apply_qkv = apply_lora_qkv`` (when q, k and v all carry LoRA)
and ``apply_o = apply_lora_o``. Those kernels read the LoRA layers' weights without calling the layers.

``served_by`` says ``unsloth`` only when the model ran and, for every adapted layer, its block (MLP or attention)
holds Unsloth's kernel and the layer never ran its own (PEFT) forward: a layer served by PEFT's forward is a
fallback, named. Unsloth's own rule sends a float32 base through PEFT's forward (its kernels assume 16 bits);
that path is Unsloth's, so it counts as served there, and ``describe`` says it.

Bare modules (the layer probes: one decoder block, no checkpoint to load): PEFT's layers with Unsloth's three
kernels installed the way ``patch_peft_model`` installs them (``fused_lora.install_fused_lora``), with
``inplace=False`` (Unsloth's default writes the input's gradient over the input's storage, which a probe reuses).
"""

from __future__ import annotations

import gc
import tempfile
import types
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from lora_suite.implementations.contract import ImplementationError, library_version, require_module
from lora_suite.implementations.fused_lora import GROUPS, fused_served_by, install_fused_lora
from lora_suite.implementations.peft_bnb_impl import BnbBase
from lora_suite.implementations.peft_impl import PeftImplementation, adapted_modules, count_call, trainable_in

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HINT = "install lora-gpu-suite[unsloth] (unsloth and unsloth_zoo, on a CUDA GPU)"
FP32_RULE = (
    "a float32 base runs PEFT's forward (Unsloth's patch_peft_model installs its kernels over 16-bit bases only)"
)
BIAS_RULE = (
    "an MLP, q/k/v or o group whose base layers carry a bias runs PEFT's forward (patch_peft_model installs a kernel "
    "only where every base layer of its group has bias None)"
)


def unsloth_mlp_kernel(activation: str) -> str:
    """The MLP kernel Unsloth's ``patch_peft_model`` runs: SwiGLU for SiLU models, its tanh GeGLU approximation for
    Gemma's ``gelu_pytorch_tanh``, the exact one for ``gelu``; nothing else (it refuses the model type)."""
    kernels = {"silu": "apply_lora_mlp_swiglu", "gelu_pytorch_tanh": "apply_lora_mlp_geglu_approx"}
    kernels["gelu"] = "apply_lora_mlp_geglu_exact"
    if activation not in kernels:
        raise ImplementationError(f"unsloth: MLP activation {activation!r}: expected one of {sorted(kernels)}")
    return kernels[activation]


class UnslothImplementation(BnbBase, PeftImplementation):
    name = expected_path = "unsloth"
    separate_reference = True  # the architecture checks' float64 reference: in a fresh process (the patches below)
    not_applicable = dict(
        PeftImplementation.not_applicable,
        op_call_count="PEFT's layers under Unsloth's kernels keep no call counter; served_by() checks the kernels and "
        "the layers' own forward calls instead",
        lora_core_ops="these tests call lora_core's cupy op and kernels directly, which Unsloth does not use",
        partial_groups="Unsloth installs its fused QKV kernel only where q, k and v all carry LoRA "
        "(patch_peft_model); on part of the group it runs PEFT's forward",
        inputs_2d="Unsloth's SwiGLU kernel unpacks (batch, seq_len, hidden) from its input (an H100 run at 8c77885: "
        "'not enough values to unpack (expected 3, got 2)' in unsloth/kernels/swiglu.py); 2-D cases run as "
        "(1, tokens, features)",
        cuda_graph_capture="Unsloth's fused cross-entropy invalidates stream capture (an H100 run at f266ade: "
        "cudaErrorStreamCaptureInvalidated in unsloth_zoo/fused_losses/fused_linear.py, _keep_index)",
        float64_reference_model="Unsloth replaces transformers' model code when it is imported (FastLlamaModel's "
        "pre_patch, unsloth_zoo's temporary_patches), so a float64 copy of the model in the same process runs "
        "Unsloth's code, not an independent reference (an H100 run at d75fb77: 'Expected mat_a to be Float32, "
        "BFloat16 or Float16 matrix, got Double' in unsloth_compiled_cache/moe_utils.py for the float64 Qwen3-MoE)",
        rank_pattern="Unsloth's FastLanguageModel.get_peft_model, the call its models are adapted through, takes one r "
        "and one lora_alpha for every target module",
        autocast_fp32_inputs="Unsloth's kernels hand fp32 activations under autocast back to PEFT's forward "
        "(unsloth/kernels/fast_lora.py, _autocast_dtype_mismatch): no Unsloth kernel to judge there",
    )

    def __init__(self):
        require_module(self.name, "unsloth", "peft", hint=HINT, when="found")
        self._declare_base()  # Unsloth's 4-bit base is bitsandbytes'

    def describe(self) -> str:
        return (
            f"unsloth: Unsloth {library_version('unsloth')} (FastLanguageModel loader, get_peft_model, fused LoRA "
            f"MLP/QKV/O kernels) over PEFT {library_version('peft')} layers; {FP32_RULE}; {BIAS_RULE}"
        )

    def preload(self) -> None:
        """``import unsloth`` before transformers is imported: Unsloth patches transformers at its import."""
        require_module(self.name, "unsloth", hint=HINT, when="use")

    def load_model(self, model: nn.Module, spec) -> nn.Module:
        if not (hasattr(model, "save_pretrained") and hasattr(model, "config")):
            return model  # a bare module: nothing to load
        fast = require_module(self.name, "unsloth", hint=HINT, when="use").FastLanguageModel
        # on the GPU: the build staged only the decoder layers. With save_pretrained and config, model is a
        # transformers model (cast inline: no other name may keep it alive past its del below)
        embeddings = cast("PreTrainedModel", model).get_input_embeddings().weight
        assert isinstance(embeddings, torch.Tensor), "an embedding's weight is a parameter"
        device, dtype = embeddings.device, embeddings.dtype
        nf4 = spec.quantize == "nf4"
        with tempfile.TemporaryDirectory(prefix="lora_suite_unsloth_") as folder:
            model.to("cpu")  # the rest of the build (embeddings, norm, LM head): the loader's model is the one trained
            cast("PreTrainedModel", model).save_pretrained(folder, safe_serialization=True)
            write_tokenizer(model, folder)
            max_len = int(getattr(model.config, "max_position_embeddings", 2048))
            del model
            gc.collect()
            torch.cuda.empty_cache()
            try:
                loaded, _tokenizer = fast.from_pretrained(
                    model_name=folder,
                    max_seq_length=max_len,
                    dtype=dtype,
                    load_in_4bit=nf4,
                    load_in_8bit=False,
                    load_in_16bit=not nf4,
                    full_finetuning=False,
                    use_gradient_checkpointing=False,  # the tier's train.gradient_checkpointing decides
                    use_exact_model_name=True,
                    local_files_only=True,
                )
            except Exception as exc:  # noqa: BLE001  (the loader's own error, named)
                raise ImplementationError(
                    f"unsloth: FastLanguageModel.from_pretrained of the built model failed: {type(exc).__name__}: {exc}"
                ) from exc
        got = next(loaded.parameters()).device
        if got.type != device.type:
            raise ImplementationError(f"unsloth: the loader put the model on {got}, the suite built it on {device}")
        loaded._lora_suite_unsloth_loaded = True
        return loaded

    def inject(self, model, spec):
        if not getattr(model, "_lora_suite_unsloth_loaded", False):
            return self._inject_bare(model, spec)
        fast = require_module(self.name, "unsloth", hint=HINT, when="use").FastLanguageModel
        targets = list(ALL_LINEAR) if tuple(spec.targets) == ("all-linear",) else list(spec.targets)
        try:
            peft_model = fast.get_peft_model(
                model,
                r=spec.r,
                target_modules=targets,
                lora_alpha=spec.alpha,
                lora_dropout=0.0,
                bias="none",
                use_gradient_checkpointing=False,
                use_rslora=spec.use_rslora,
                target_parameters=list(spec.target_parameters) or None,
            )
        except Exception as exc:  # noqa: BLE001
            raise ImplementationError(f"unsloth: get_peft_model failed: {type(exc).__name__}: {exc}") from exc
        # the PeftModel wrapper, kept outside the module tree (it holds the model: a submodule would make a cycle)
        object.__setattr__(model, "_lora_suite_unsloth", peft_model)
        model._lora_suite_peft_config = peft_model.peft_config["default"]
        adapters = self.adapter_parameters(model)
        if not adapters:
            raise ImplementationError(f"unsloth: targets {targets} adapted no layer of {type(model).__name__}")
        for p in model.parameters():
            p.requires_grad_(False)
        trainable_in(adapters, spec.adapter_dtype)
        trainable_in(self._active(model, "expert"), spec.adapter_dtype)
        paths = adapted_modules(adapters)
        # served_by() evidence: the model's forward calls, and each layer's own (PEFT) forward calls. Not its block's:
        # Unsloth compiles each decoder layer, and a counter changed inside a compiled region recompiles it each call.
        model._lora_suite_model_calls = 0
        model.register_forward_hook(_count_model)
        for path in paths:
            layer = model.get_submodule(path)
            layer._lora_suite_calls = 0
            layer.register_forward_hook(count_call)
        return paths

    def _inject_bare(self, model, spec):
        kernels = require_module(self.name, "unsloth.kernels.fast_lora", hint=HINT, when="use")
        adapted = PeftImplementation.inject(self, model, self._bnb_spec(model, spec))
        if not _fp32_base(model):
            install_fused_lora(model, kernels, mlp_kernel=unsloth_mlp_kernel, patches=unsloth_patches, inplace=False)
        return adapted

    def served_by(self, model):
        if not getattr(model, "_lora_suite_unsloth_loaded", False):
            return PeftImplementation.served_by(self, model) if _fp32_base(model) else fused_served_by(self, model)
        kernels = require_module(self.name, "unsloth.kernels.fast_lora", hint=HINT, when="use")
        if not getattr(model, "_lora_suite_model_calls", 0):
            return "unsloth, a model that never ran"
        wrong = []
        for path in adapted_modules(self.adapter_parameters(model)):
            block_path, leaf = path.rsplit(".", 1)
            layer, block = model.get_submodule(path), model.get_submodule(block_path)
            own = getattr(layer, "_lora_suite_calls", 0)
            if _fp32_base(layer) or not unsloth_patches(_group_of(block, leaf)):
                if own == 0:
                    wrong.append(f"{path}: never ran (float32 base or a biased group: PEFT's forward expected)")
            elif not _holds_kernel(block, leaf, kernels):
                wrong.append(f"{path}: its block holds no Unsloth kernel for {leaf} ({own} PEFT forward calls)")
            elif own:
                wrong.append(f"{path}: ran PEFT's own forward {own} times beside Unsloth's kernel")
        return self.expected_path if not wrong else "; ".join(wrong[:3]) + (" ..." if len(wrong) > 3 else "")


def unsloth_patches(projections) -> bool:
    """Unsloth's rule (``patch_peft_model``) for one group of projections: its kernel only where every base layer
    has no bias and no DoRA magnitude."""
    for proj in projections:
        if getattr(getattr(proj, "base_layer", proj), "bias", None) is not None:
            return False
        if len(getattr(proj, "lora_magnitude_vector", None) or []):
            return False
    return True


def _group_of(block: nn.Module, leaf: str) -> list[nn.Module]:
    """The projections of ``block`` that share ``leaf``'s kernel (``fused_lora.GROUPS``)."""
    names = next((names for names in GROUPS.values() if leaf in names), (leaf,))
    return [getattr(block, n) for n in names if hasattr(block, n)]


def _count_model(module, args, output) -> None:
    module._lora_suite_model_calls += 1


def _holds_kernel(block: nn.Module, leaf: str, kernels) -> bool:
    """Whether ``block`` runs Unsloth's kernel for its ``leaf`` projection (what ``patch_peft_model`` installs)."""
    if leaf in ("gate_proj", "up_proj", "down_proj"):
        forward = getattr(block, "_unsloth_forward", None) or block.forward
        return isinstance(forward, types.MethodType) and forward.__func__ is kernels.apply_lora_mlp_swiglu
    if leaf in ("q_proj", "k_proj", "v_proj"):
        return getattr(block, "apply_qkv", None) is kernels.apply_lora_qkv
    if leaf == "o_proj":
        return getattr(block, "apply_o", None) is kernels.apply_lora_o
    return False


def _fp32_base(module: nn.Module) -> bool:
    """Whether the first base weight under ``module`` is float32 (Unsloth's rule for declining its kernels)."""
    for name, p in module.named_parameters():
        if "lora_" not in name and p.dim() == 2:
            return p.dtype == torch.float32
    return False


def write_tokenizer(model: nn.Module, folder: str | Path) -> None:
    """A tokenizer in ``folder`` for Unsloth's loader, which reads one beside the weights: the checkpoint's own where
    the model came from a local folder that has one, else a byte-level one (ids 0-255, then BOS, EOS, PAD: the
    suite's ``ByteTokenizer``), which the suite's data never use (they are tokenised by the suite)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    source = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    if source.is_dir() and any((source / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        AutoTokenizer.from_pretrained(str(source), local_files_only=True).save_pretrained(folder)
        return
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"<0x{i:02X}>": i for i in range(256)} | {"<s>": 256, "</s>": 257, "<pad>": 258}
    vocab_size = int(getattr(model.config, "vocab_size", 0))
    if vocab_size < len(vocab):
        raise ImplementationError(f"unsloth: the model's vocab_size {vocab_size} is below the byte tokenizer's 259 ids")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<0x00>")),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<0x00>",
        model_max_length=int(getattr(model.config, "max_position_embeddings", 2048)),
    )
    tok.save_pretrained(folder)
