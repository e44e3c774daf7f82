"""The fused-kernel LoRA stacks judged beside lora_core: ``axolotl`` and ``peft-liger``, both over PEFT's layers.

- ``axolotl``: PEFT's LoRA layers driven by Axolotl's kernels (``axolotl.kernels.lora``), applied the way its
  ``lora_mlp_kernel`` / ``lora_qkv_kernel`` / ``lora_o_kernel`` flags apply them: each decoder layer's MLP
  forward becomes ``apply_lora_mlp_swiglu`` (its LoRA_MLP Function with a Triton SwiGLU), q/k/v come from one
  ``apply_lora_qkv`` call per input, and o_proj from ``apply_lora_o``. Installed with ``pip install --no-deps
  axolotl`` plus triton and bitsandbytes, which its kernel module imports. Axolotl patches the attention
  class's forward source to call ``apply_qkv``; here the three projections hand their call to one group
  instead (the attention code is not touched), which runs the same Function on the same input.
- ``peft-liger``: PEFT's LoRA layers with Liger-Kernel's fused RMSNorm, RoPE, SwiGLU and fused linear
  cross-entropy (``lora_suite.implementations.liger_ops``).

``served_by`` names the path: each stack is its name only when every adapted layer ran through it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import types

from lora_suite.implementations.contract import ImplementationError
from lora_suite.implementations.peft_impl import PeftImplementation

NO_BNB = (
    "bitsandbytes does not import here, and this peer's 4-bit base is bitsandbytes' (install lora-gpu-suite[peft-bnb])"
)


class BnbBase:
    """QLoRA as these peers run it: a bitsandbytes NF4 base (``peft-bnb``'s ``Linear4bit``, quantised layer by layer
    as the model is built) under PEFT's bitsandbytes LoRA layers, where bitsandbytes imports; where it does not,
    ``nf4_base`` is declared not applicable with that reason, so a tier never runs 16-bit without saying so."""

    def _declare_base(self) -> None:
        if importlib.util.find_spec("bitsandbytes") is None:
            self.not_applicable = dict(self.not_applicable, nf4_base=NO_BNB)
        else:
            self.not_applicable = {k: v for k, v in self.not_applicable.items() if k != "nf4_base"}

    def quantize_base(self, model) -> bool:
        from lora_suite.implementations.peft_bnb_impl import PeftBnbImplementation

        return PeftBnbImplementation.quantize_base(self, model)

    def _bnb_spec(self, model, spec):
        """``spec`` for PEFT's inject: an NF4 request puts bitsandbytes' base in first and marks the model 4-bit, as
        transformers does, so that PEFT wraps its bitsandbytes layer."""
        if spec.quantize is None:
            return spec
        if spec.quantize != "nf4" or self.reason_not_applicable("nf4_base"):
            raise ImplementationError(
                f"{self.name}: quantize={spec.quantize!r}: {self.reason_not_applicable('nf4_base')}"
            )
        self.quantize_base(model)
        model.is_loaded_in_4bit = True
        return dataclasses.replace(spec, quantize=None)


def _import(module: str, who: str, hint: str):
    import importlib

    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001  (an import that fails for any reason: say which and why)
        raise ImplementationError(f"{who}: {module} does not import ({type(exc).__name__}: {exc}); {hint}") from None


class _QKVCall:
    """q, k and v of one attention from one Axolotl ``apply_lora_qkv`` call on the same input."""

    def __init__(self, attn, apply_qkv):
        self.attn, self.apply_qkv = attn, apply_qkv
        self.x, self.pending = None, {}

    def take(self, role: int, x):
        if self.x is not x or role not in self.pending:
            self.x, self.pending = x, dict(enumerate(self.apply_qkv(self.attn, x)))
        out = self.pending.pop(role)
        if not self.pending:
            self.x = None
        return out


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _require_installed(who: str, modules: tuple[str, ...], hint: str) -> None:
    """Refuse at selection (not mid-run) when a package the stack needs is absent, naming it."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImplementationError(f"--lora-impl {who}: {', '.join(missing)} not installed; {hint}")


def _count(*layers):
    for layer in layers:
        layer._fused_calls = getattr(layer, "_fused_calls", 0) + 1


class AxolotlImplementation(BnbBase, PeftImplementation):
    name = expected_path = "axolotl"
    not_applicable = dict(PeftImplementation.not_applicable)

    def __init__(self):
        _require_installed(
            "axolotl",
            ("peft", "axolotl", "triton", "bitsandbytes"),
            "pip install peft triton bitsandbytes and pip install --no-deps axolotl",
        )
        self._declare_base()  # Axolotl's kernels dequantise bitsandbytes 4-bit bases themselves (QLoRA)
        self.not_applicable = dict(
            self.not_applicable,
            inputs_2d="Axolotl's SwiGLU kernel unpacks (batch, seq_len, hidden) from its input (an H100 run at "
            "a988569: 'not enough values to unpack (expected 3, got 2)'); 2-D cases run as (1, tokens, features)",
            autocast_fp32_inputs="Axolotl's LoRA Functions multiply fp32 activations by 16-bit weights without "
            "autocast's cast (an H100 run at 9ea3c11: 'self and mat2 must have the same dtype, but got BFloat16 and "
            "Float')",
        )

    def describe(self) -> str:
        return f"axolotl: PEFT layers driven by Axolotl {_version('axolotl')}'s LoRA MLP/QKV/O kernels"

    def inject(self, model, spec):
        kernels = _import(
            "axolotl.kernels.lora",
            "axolotl",
            "pip install --no-deps axolotl, with triton and bitsandbytes (what axolotl.kernels.lora imports)",
        )
        adapted = super().inject(model, self._bnb_spec(model, spec))
        install_fused_lora(model, kernels)
        return adapted

    def served_by(self, model):
        return fused_served_by(self, model)


def install_fused_lora(model, kernels, **options) -> None:
    """The LoRA kernels of ``kernels`` (Axolotl's ``axolotl.kernels.lora`` or Unsloth's
    ``unsloth.kernels.fast_lora``: the same three entry points) put over PEFT's layers in ``model``: each block's
    MLP forward becomes ``apply_lora_mlp_swiglu``, q/k/v come from one ``apply_lora_qkv`` call per input, o_proj
    from ``apply_lora_o``. ``options`` go to the MLP and QKV calls. Every kernel call is counted on the layers it
    served (``_fused_calls``), for ``fused_served_by``. A kernel that hands a call back to the layers (Unsloth's do,
    under autocast or for a LoRA variant) reaches PEFT's own forward of the projection, which its hook counts."""
    for module in model.modules():
        if all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):

            def mlp_forward(self, x, _k=kernels):
                _count(self.gate_proj, self.up_proj, self.down_proj)
                return _k.apply_lora_mlp_swiglu(self, x, **options)

            module.forward = types.MethodType(mlp_forward, module)
            for proj in (module.gate_proj, module.up_proj, module.down_proj):
                proj._fused_by_block = True  # never called on the kernel's path: any call of its own is PEFT's
        if all(hasattr(module, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            call = _QKVCall(module, lambda attn, x, _k=kernels: _k.apply_lora_qkv(attn, x, **options))
            for role, proj in enumerate((module.q_proj, module.k_proj, module.v_proj)):

                def proj_forward(self, x, _call=call, _role=role, _attn=module):
                    if _attn._in_fused_kernel:  # the kernel called the layer back: PEFT's own forward
                        return type(self).forward(self, x)
                    _count(self)
                    with _inside(_attn):
                        return _call.take(_role, x)

                proj.forward = types.MethodType(proj_forward, proj)

            def o_forward(self, x, _attn=module, _k=kernels):
                if _attn._in_fused_kernel:
                    return type(self).forward(self, x)
                _count(self)
                with _inside(_attn):
                    return _k.apply_lora_o(_attn, x)

            module._in_fused_kernel = False
            module.o_proj.forward = types.MethodType(o_forward, module.o_proj)


@contextlib.contextmanager
def _inside(block):
    block._in_fused_kernel = True
    try:
        yield
    finally:
        block._in_fused_kernel = False


def fused_served_by(impl, model) -> str:
    """``impl.expected_path`` when every adapted layer ran through a kernel of ``install_fused_lora`` on every call
    and never through PEFT's own forward. The PEFT injection's forward hook counts each call of a layer
    (``_lora_suite_calls``), the patched forwards count the kernel's (``_fused_calls``): a q/k/v/o layer is called
    once per kernel call, so more calls than kernel calls are PEFT's; an MLP layer is never called on the kernel's
    path (the MLP kernel reads its parameters), so any call of it is PEFT's."""
    wrong = []
    for path in sorted({n.rsplit(".", 1)[0] for n in impl.adapter_parameters(model)}):
        layer = model.get_submodule(path)
        fused, calls = getattr(layer, "_fused_calls", 0), getattr(layer, "_lora_suite_calls", 0)
        peft_calls = calls if getattr(layer, "_fused_by_block", False) else calls - fused
        if fused == 0 or peft_calls > 0:
            wrong.append(f"{path}: {fused} calls through a {impl.name} kernel, {peft_calls} through PEFT's forward")
    return impl.expected_path if not wrong else "; ".join(wrong[:3]) + (" ..." if len(wrong) > 3 else "")


class PeftLigerImplementation(BnbBase, PeftImplementation):
    name = expected_path = "peft-liger"
    not_applicable = dict(PeftImplementation.not_applicable)

    def __init__(self):
        _require_installed("peft-liger", ("peft", "liger_kernel"), "install lora-gpu-suite[liger]")
        from lora_suite.implementations.liger_ops import NOT_CAPTURABLE

        self.not_applicable = dict(self.not_applicable, cuda_graph_capture=NOT_CAPTURABLE)
        self._declare_base()  # Liger's ops run over PEFT's bitsandbytes layers as over its 16-bit ones

    def describe(self) -> str:
        return f"peft-liger: PEFT layers with Liger-Kernel {_version('liger-kernel')}'s fused non-LoRA ops"

    def inject(self, model, spec):
        from lora_suite.implementations.liger_ops import FusedOpsError, apply_liger_ops

        _import("liger_kernel.transformers", "peft-liger", "pip install liger-kernel")
        adapted = super().inject(model, self._bnb_spec(model, spec))
        if type(model).__name__ == "LlamaForCausalLM":  # the whole model (PEFT injects it whole, not per layer)
            try:
                apply_liger_ops(model)
            except FusedOpsError as exc:
                raise ImplementationError(f"peft-liger: {exc}") from None
        return adapted

    def served_by(self, model):
        from lora_suite.implementations.liger_ops import describe_liger

        peft_path = super().served_by(model)
        if peft_path != "peft-liger":  # PeftImplementation reports its own name when every layer served
            return peft_path
        if type(model).__name__ != "LlamaForCausalLM":  # a layer probe: Liger's ops are a whole Llama's, none here
            return self.expected_path
        liger = describe_liger(model)
        return self.expected_path if liger != "none" else "PEFT layers without Liger's ops"
