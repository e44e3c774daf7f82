"""Fused non-LoRA ops under any implementation: Liger-Kernel's RMSNorm, RoPE, SwiGLU (GeGLU on Gemma 2) and fused
linear cross-entropy (the loss over the vocabulary without materialising the logits), applied to one model instance
of a family Liger covers (``FAMILIES``: Llama, Qwen2, Gemma 2).

``liger_ops(model, swiglu=...)`` is a context manager (``apply_liger_ops`` its body): Liger patches some of
transformers' module-level names (``apply_rotary_pos_emb``, the family's RMSNorm and MLP classes) besides the
instance, so the names are put back on exit and a model of another stack built later in the same process runs
transformers' own ops. ``swiglu=False`` where the MLP is already fused (lora_core's ``LoRAMLP``).
``describe_liger(model)`` says what is in place, for ``served_by`` and the reports.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import NamedTuple

from torch import nn

from lora_core.loss_head import loss_head

FUSED_OPS = ("liger",)
# Seen on an H100 (Liger-Kernel 0.8.5, torch 2.11, 88062a8): the convergence tier's capture stopped inside
# liger_kernel/ops/fused_linear_cross_entropy.py with "operation not permitted when stream is capturing".
NOT_CAPTURABLE = (
    "Liger's fused linear cross-entropy cannot be captured in a CUDA graph (it stopped the capture with "
    "'operation not permitted when stream is capturing')"
)
LCE_LEFT_OUT = (
    f"{NOT_CAPTURABLE}: captured steps get Liger's RMSNorm, RoPE and SwiGLU, and transformers' own loss over "
    "materialised logits"
)


class Family(NamedTuple):
    entry: str  # Liger's entry point in liger_kernel.transformers
    module: str  # transformers' modeling module whose names it patches
    prefix: str  # the family's class-name prefix in that module ("Llama": LlamaRMSNorm, LlamaMLP)
    mlp_switch: str  # the entry point's argument for its fused MLP (SwiGLU, or GeGLU for Gemma 2)

    @property
    def mlp(self) -> str:
        """transformers' own MLP class: Liger's fused MLP replaces it only where it is still in place."""
        return f"{self.prefix}MLP"

    @property
    def names(self) -> tuple[str, ...]:
        """The module-level names the entry point patches (put back by ``restored_names``)."""
        return ("apply_rotary_pos_emb", f"{self.prefix}RMSNorm", self.mlp)


# The decoder families Liger's ops are applied to, by the model's class (Liger-Kernel's monkey_patch.py)
FAMILIES = {
    "LlamaForCausalLM": Family(
        "apply_liger_kernel_to_llama", "transformers.models.llama.modeling_llama", "Llama", "swiglu"
    ),
    "Qwen2ForCausalLM": Family(
        "apply_liger_kernel_to_qwen2", "transformers.models.qwen2.modeling_qwen2", "Qwen2", "swiglu"
    ),
    "Gemma2ForCausalLM": Family(
        "apply_liger_kernel_to_gemma2", "transformers.models.gemma2.modeling_gemma2", "Gemma2", "geglu"
    ),
}


class FusedOpsError(RuntimeError):
    """The fused ops asked for cannot be applied here; the message names the missing package or the model."""


def _liger():
    try:
        return importlib.import_module("liger_kernel.transformers")
    except ImportError as exc:
        raise FusedOpsError(
            f"--fused-ops liger needs Liger-Kernel, which does not import ({exc}); pip install liger-kernel"
        ) from exc


@contextlib.contextmanager
def restored_names():
    """Put back, on exit, transformers' module-level names that Liger patches, of every family in ``FAMILIES`` (for
    a process that builds other stacks' models afterwards)."""
    saved = []
    for fam in FAMILIES.values():
        module = importlib.import_module(fam.module)
        saved += [(module, name, getattr(module, name)) for name in fam.names]
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


# The same families by the suite's model-config name (configs/models/*.yaml, ``architecture.family``)
LIGER_FAMILIES = ("llama", "qwen2", "gemma2")


def family_of(model: nn.Module) -> Family:
    """The ``Family`` of ``model``'s class; a FusedOpsError naming the class and the families otherwise."""
    fam = FAMILIES.get(type(model).__name__)
    if fam is None:
        raise FusedOpsError(f"--fused-ops liger: a model of {sorted(FAMILIES)} is expected, got {type(model).__name__}")
    return fam


def apply_liger_ops(model: nn.Module, *, swiglu: bool | None = None, captured: bool = False) -> nn.Module:
    """Apply Liger's RMSNorm, RoPE, fused linear cross-entropy (and SwiGLU unless the MLP is fused) to ``model``,
    leaving Liger's module-level patches in place (a process that runs one stack: a tier run, a scorecard lane).

    The model is one of ``FAMILIES`` (Llama, Qwen2, Gemma 2). ``swiglu=None``: Liger's fused MLP (SwiGLU; GeGLU on
    Gemma 2) wherever every MLP is still transformers' own (an MLP that is already fused, lora_core's ``LoRAMLP``,
    keeps its own). ``captured``: the steps will be captured in a CUDA
    graph, so the fused linear cross-entropy (``NOT_CAPTURABLE``) is left out and the loss is transformers' own;
    RMSNorm, RoPE and SwiGLU are plain Triton launches, which a capture records (the trainer's eager warm-up steps
    compile them first). The caller records the left-out op (``LCE_LEFT_OUT``). A model whose loss lora_core already
    fuses (``lora_core.loss_head``, cupy-fused) keeps that loss, eager or captured."""
    liger = _liger()
    fam = family_of(model)
    if swiglu is None:
        layers = model.get_submodule("model.layers")
        assert isinstance(layers, nn.ModuleList), "the FAMILIES' decoders hold their layers in a ModuleList"
        swiglu = all(  # not an MLP already fused, nor one whose forward a stack replaced (axolotl's)
            type(layer.mlp).__name__ == fam.mlp and "forward" not in vars(layer.mlp) for layer in layers
        )
    getattr(liger, fam.entry)(
        rope=True,
        rms_norm=True,
        cross_entropy=False,
        fused_linear_cross_entropy=not captured and loss_head(model) is None,
        model=model,
        **{fam.mlp_switch: swiglu},
    )
    return model


@contextlib.contextmanager
def liger_ops(model: nn.Module, *, swiglu: bool | None = None, captured: bool = False):
    """``apply_liger_ops`` for the duration of the block, transformers' module-level names put back on exit."""
    with restored_names():
        yield apply_liger_ops(model, swiglu=swiglu, captured=captured)


def describe_liger(model: nn.Module) -> str:
    """Which Liger ops the model holds (Liger renames what it patches: ``_get_name()``); "none" when there are none.
    A loss fused by lora_core is named beside them."""
    own = "" if loss_head(model) is None else "; the loss: lora_core's fused linear cross-entropy"
    names = [m._get_name() for m in model.modules()]
    norms = sum(n.startswith("LigerRMSNorm") for n in names)
    mlps = sum(n in ("LigerSwiGLUMLP", "LigerGEGLUMLP") for n in names)
    forward = getattr(model.forward, "__func__", model.forward)
    lce = "lce" in getattr(forward, "__name__", "")
    if not (norms or mlps or lce):
        return "none" + own
    return f"liger: rms_norm x{norms}, swiglu x{mlps}, fused linear cross-entropy {'on' if lce else 'off'}{own}"
