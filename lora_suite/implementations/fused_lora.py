"""LoRA kernels over PEFT's layers, as the fused stacks install them (``install_fused_lora``: Axolotl's
``axolotl.kernels.lora`` and Unsloth's ``unsloth.kernels.fast_lora`` share its three entry points), and the
``served_by`` that judges them (``fused_served_by``). Axolotl patches the attention class's forward source to call
``apply_qkv``; here the three projections hand their call to one group instead (the attention code is not touched),
which runs the same Function on the same input."""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Callable


class _QKVCall:
    """q, k and v of one attention from one ``apply_lora_qkv`` call on the same input."""

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


def _count(*layers):
    for layer in layers:
        layer._fused_calls = getattr(layer, "_fused_calls", 0) + 1


def activation_of(model) -> str | None:
    """The MLP activation ``model``'s config names (``hidden_act``, else ``hidden_activation``, of its text config
    where it has one: where the stacks' patchers read it); None for a module without a config (the suite's probe
    block, whose MLP is SwiGLU)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)


def swiglu_only(activation: str) -> str:
    return "apply_lora_mlp_swiglu"


def _accepted(fn, options: dict) -> dict:
    """The ``options`` ``fn``'s signature takes (Unsloth's GeGLU approximation takes no ``inplace``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return options
    return {k: v for k, v in options.items() if k in params}


GROUPS = {"mlp": ("gate_proj", "up_proj", "down_proj"), "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",)}


def patches_every_group(projections) -> bool:
    return True


def install_fused_lora(
    model, kernels, mlp_kernel: Callable[[str], str] = swiglu_only, patches: Callable = patches_every_group, **options
) -> None:
    """The LoRA kernels of ``kernels`` (Axolotl's ``axolotl.kernels.lora`` or Unsloth's
    ``unsloth.kernels.fast_lora``: the same entry points) put over PEFT's layers in ``model``: each block's MLP
    forward becomes the MLP kernel ``mlp_kernel`` names for the model's activation (``activation_of``; "silu" where
    there is no config), the way the stack's own patcher chooses it; q/k/v come from one ``apply_lora_qkv`` call per
    input, o_proj from ``apply_lora_o``. ``options`` go to the MLP (those its signature takes) and QKV calls. Every
    kernel call is counted on the layers it served (``_fused_calls``), for ``fused_served_by``. A kernel that hands a
    call back to the layers (Unsloth's do, under autocast or for a LoRA variant) reaches PEFT's own forward of the
    projection, which its hook counts. ``patches(projections)`` is the stack's own rule for a group (MLP, q/k/v, o):
    a group it declines keeps PEFT's forward, as the stack's patcher leaves it, marked ``_declined_by_stack``."""
    apply_mlp = getattr(kernels, mlp_kernel(activation_of(model) or "silu"))
    mlp_options = _accepted(apply_mlp, options)
    for module in model.modules():
        declined = {g for g, names in GROUPS.items() if _declined(module, names, patches)}
        if all(hasattr(module, p) for p in GROUPS["mlp"]) and "mlp" not in declined:

            def mlp_forward(self, x, _apply=apply_mlp):
                _count(self.gate_proj, self.up_proj, self.down_proj)
                return _apply(self, x, **mlp_options)

            module.forward = types.MethodType(mlp_forward, module)
            for proj in (module.gate_proj, module.up_proj, module.down_proj):
                proj._fused_by_block = True  # never called on the kernel's path: any call of its own is PEFT's
        if all(hasattr(module, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            _install_attention(module, kernels, declined, options)


def _declined(module, names, patches) -> bool:
    """Whether the stack's rule ``patches`` leaves ``module``'s group ``names`` to PEFT (marking its layers so)."""
    if not all(hasattr(module, n) for n in names):
        return False
    projections = [getattr(module, n) for n in names]
    if patches(projections):
        return False
    for proj in projections:
        proj._declined_by_stack = True
    return True


def _install_attention(module, kernels, declined: set, options: dict) -> None:
    """q/k/v from one ``apply_lora_qkv`` call, o_proj from ``apply_lora_o``: each group unless the stack declines it."""
    module._in_fused_kernel = False
    if "qkv" not in declined:
        call = _QKVCall(module, lambda attn, x, _k=kernels: _k.apply_lora_qkv(attn, x, **options))
        for role, proj in enumerate((module.q_proj, module.k_proj, module.v_proj)):

            def proj_forward(self, x, _call=call, _role=role, _attn=module):
                if _attn._in_fused_kernel:  # the kernel called the layer back: PEFT's own forward
                    return type(self).forward(self, x)
                _count(self)
                with _inside(_attn):
                    return _call.take(_role, x)

            proj.forward = types.MethodType(proj_forward, proj)

    if "o" not in declined:

        def o_forward(self, x, _attn=module, _k=kernels):
            if _attn._in_fused_kernel:
                return type(self).forward(self, x)
            _count(self)
            with _inside(_attn):
                return _k.apply_lora_o(_attn, x)

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
        if getattr(layer, "_declined_by_stack", False):  # the stack's own rule left it to PEFT: PEFT's forward is due
            if calls == 0 or fused:
                wrong.append(f"{path}: declined by {impl.name}'s rule, yet {calls} PEFT and {fused} kernel calls")
        elif fused == 0 or peft_calls > 0:
            wrong.append(f"{path}: {fused} calls through a {impl.name} kernel, {peft_calls} through PEFT's forward")
    return impl.expected_path if not wrong else "; ".join(wrong[:3]) + (" ..." if len(wrong) > 3 else "")
