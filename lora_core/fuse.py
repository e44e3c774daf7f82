"""Route a LoRA-injected Llama-family model through the fused paths: ``fuse_lora(model, ("mlp", "qkv", "o"))``.

- ``"mlp"``: every MLP whose gate_proj, up_proj and down_proj are all ``LoRALinear`` and whose activation is SiLU
  (SwiGLU) or the tanh GELU (Gemma's GeGLU) is replaced by ``LoRAMLP``, which keeps the three layers as children
  (same parameter names, same adapters, same PEFT files) and runs ``lora_core.ops.fused_mlp``.
- ``"qkv"``: every attention whose q_proj, k_proj and v_proj are all ``LoRALinear`` gets one ``QKVGroup``: the
  first of the three projections called on an input computes all three (``lora_core.ops.fused_qkv``) and the
  other two take their part of that result (the attention module itself is not changed).
- ``"o"``: o_proj already runs as one autograd Function that fuses the base and LoRA products and reuses its
  saved ``x Aᵀ`` (what Unsloth and Axolotl call the fused LoRA O): nothing is changed, and its path is
  reported as the plain backend's.

For the 16-bit bases, gate and up (q, k and v) are moved into one buffer, each layer's ``weight`` becoming a view
of its part, so the fused GEMM reads one operand without a copy per step; NF4 bases are dequantised into the
parts of one scratch buffer each pass. Every adapted layer reports the path that served it in ``last_backend``
(``"cupy-fused-mlp"``, ``"cupy-fused-qkv"``). What cannot be fused is refused by name, never run unfused:
a requested part that matches nothing, an MLP gated by another activation, projections with different ranks or
scales. Biases are taken (Qwen2's q/k/v; an MLP's), frozen, each broadcast into its output before the GEMMs.
LoRA dropout does not exist in ``lora_core``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lora_core.backend import resolve_backend
from lora_core.layer import LoRALinear
from lora_core.ops.fused_mlp import MLPBases, lora_mlp
from lora_core.ops.fused_qkv import QKVBases, lora_qkv

FUSABLE = ("mlp", "qkv", "o")
MLP_PARTS = ("gate_proj", "up_proj", "down_proj")
QKV_PARTS = ("q_proj", "k_proj", "v_proj")
GROUPS = {"mlp": MLP_PARTS, "qkv": QKV_PARTS}  # the fusable groups: what a part of ``fuse`` fuses


class FuseError(ValueError):
    """A requested fusion that this model or these adapters cannot take; the message names what and why."""


def _require(where: str, group: str, parts: Mapping[str, object]) -> dict[str, LoRALinear]:
    """``parts`` (name -> module, None where there is none) as LoRA layers; a FuseError names what keeps them from
    being fused as ``group``: a part that is not a LoRA layer, different ranks, scales or base storage."""
    not_lora = [n for n, m in parts.items() if not isinstance(m, LoRALinear)]
    if not_lora:
        raise FuseError(
            f"fuse={group!r} at {where}: {not_lora} are not LoRA layers (targets must include all of "
            f"{list(parts)} to fuse them)"
        )
    layers = {n: m for n, m in parts.items() if isinstance(m, LoRALinear)}  # all of parts, in its order
    ranks = {n: (m.r, m.scale) for n, m in layers.items()}
    if len(set(ranks.values())) != 1:
        raise FuseError(f"fuse={group!r} at {where}: (r, scale) differ between the projections: {ranks}")
    quant = {n: m.quantize for n, m in layers.items()}
    if len(set(quant.values())) != 1:
        raise FuseError(f"fuse={group!r} at {where}: the bases are stored differently: {quant}")
    return layers


def _shared_base(layers: list[LoRALinear], cache: dict) -> torch.Tensor:
    """[W_1; W_2; ...] as one tensor whose row parts are the layers' ``weight`` (rebuilt when a layer's weight is no
    longer a view of it: after ``.to()``, or an assignment)."""
    buf = cache.get("buf")
    if buf is not None:
        start, ok = 0, True
        for m in layers:
            w = m.dense_weight()
            ok = ok and w.device == buf.device and w.dtype == buf.dtype and w.data_ptr() == buf[start:].data_ptr()
            start += w.shape[0]
        if ok:
            return buf
    buf = torch.cat([m.dense_weight().detach() for m in layers])
    start = 0
    for m in layers:
        rows = m.dense_weight().shape[0]
        m.weight = nn.Parameter(buf[start : start + rows], requires_grad=False)
        start += rows
    cache["buf"] = buf
    return buf


def _stacked_bias(layers: list[LoRALinear], cache: dict) -> torch.Tensor | None:
    """[b_1; b_2; ...] of ``layers`` (zeros for a layer without one), None when none has a bias; rebuilt only when a
    bias changed (another tensor, dtype, device or an in-place update)."""
    biases = [_frozen_bias(m) for m in layers]
    if all(b is None for b in biases):
        return None
    key = tuple(None if b is None else (b.data_ptr(), b.dtype, b.device, b._version) for b in biases)
    if cache.get("bias_key") != key:
        ref = next(b for b in biases if b is not None)
        parts = [b.detach() if b is not None else ref.new_zeros(m.out_features) for b, m in zip(biases, layers)]
        cache["bias"], cache["bias_key"] = torch.cat(parts), key
    return cache["bias"]


def _frozen_bias(layer: LoRALinear) -> torch.Tensor | None:
    """The layer's bias, which the fused paths take as a constant: one that requires grad is refused by name (its
    gradient would be lost, not computed)."""
    if layer.bias is not None and layer.bias.requires_grad:
        raise FuseError(
            f"a fused {type(layer).__name__} ({layer.in_features}->{layer.out_features}) has a bias that requires "
            "grad; the fused paths take frozen biases only (requires_grad_(False), or run the unfused layer)"
        )
    return layer.bias


_GATES = {  # the gate activations the fused MLP computes, as torch computes them (the probe's reference)
    "silu": torch.nn.functional.silu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
}


def gate_activation(act) -> str | None:
    """ "silu" or "gelu_tanh" for a module computing SiLU or the tanh GELU (nn.SiLU, transformers' SiLUActivation,
    ``gelu_pytorch_tanh``): probed on [-8, 8] in float64, not named; None for any other activation."""
    if isinstance(act, nn.SiLU):
        return "silu"
    if not isinstance(act, nn.Module):
        return None
    probe = torch.linspace(-8, 8, 33, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = act(probe)
    except Exception:  # noqa: BLE001  (an activation that cannot take the probe is neither)
        return None
    for name, fn in _GATES.items():
        if got.shape == probe.shape and bool(torch.allclose(got, fn(probe), rtol=1e-12, atol=1e-12)):
            return name
    return None


class LoRAMLP(nn.Module):
    """A Llama MLP with LoRA on gate, up and down, served by the fused path (children keep their names)."""

    def __init__(self, mlp: nn.Module, where: str = "mlp"):
        super().__init__()
        parts = _require(where, "mlp", {n: getattr(mlp, n, None) for n in MLP_PARTS})
        act = getattr(mlp, "act_fn", None)
        gate = gate_activation(act)
        if gate is None:
            raise FuseError(
                f"fuse='mlp' at {where}: the activation is {type(act).__name__}, but the fused MLP takes a SiLU gate "
                "(SwiGLU) or a tanh-GELU gate (GeGLU) only"
            )
        self.activation = gate
        if parts["gate_proj"].out_features != parts["up_proj"].out_features:
            raise FuseError(f"fuse='mlp' at {where}: gate and up have different widths")
        self.gate_proj, self.up_proj, self.down_proj = (parts[n] for n in MLP_PARTS)
        self.act_fn = act
        self._cache: dict = {}

    def bases(self) -> MLPBases:
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        b_d = _frozen_bias(d)
        b_gu, b_d = _stacked_bias([g, u], self._cache), None if b_d is None else b_d.detach()
        if g.quantize == "nf4":
            return MLPBases(nf4=(g.nf4_base(), u.nf4_base(), d.nf4_base()), bias_gu=b_gu, bias_d=b_d)
        return MLPBases(w_gu=_shared_base([g, u], self._cache), w_d=d.dense_weight(), bias_gu=b_gu, bias_d=b_d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        backend = resolve_backend(g.backend, x.device)
        adapters = (g.lora_A, g.lora_B, u.lora_A, u.lora_B, d.lora_A, d.lora_B)
        y = lora_mlp(x, self.bases(), adapters, g.scale, d.scale, backend=backend, activation=self.activation)
        for m in (g, u, d):
            m.last_backend = f"{backend}-fused-mlp"
        return y


class QKVGroup:
    """q_proj, k_proj and v_proj of one attention, computed together (not a module: the layers stay where they
    are; each holds this object and hands its forward to it)."""

    def __init__(self, layers: tuple[LoRALinear, LoRALinear, LoRALinear]):
        self.layers = layers
        self._cache: dict = {}
        self._x: torch.Tensor | None = None
        self._pending: dict[int, torch.Tensor] = {}

    def bases(self) -> QKVBases:
        q, k, v = self.layers
        sizes = (q.out_features, k.out_features, v.out_features)
        bias = _stacked_bias(list(self.layers), self._cache)
        if q.quantize == "nf4":
            return QKVBases(sizes, nf4=(q.nf4_base(), k.nf4_base(), v.nf4_base()), bias=bias)
        return QKVBases(sizes, w_qkv=_shared_base(list(self.layers), self._cache), bias=bias)

    def __call__(self, layer: LoRALinear, x: torch.Tensor) -> torch.Tensor:
        role = next(i for i, m in enumerate(self.layers) if m is layer)
        if self._x is not x or role not in self._pending:  # a new input: compute q, k and v of it together
            q, k, v = self.layers
            backend = resolve_backend(q.backend, x.device)
            adapters = (q.lora_A, q.lora_B, k.lora_A, k.lora_B, v.lora_A, v.lora_B)
            outs = lora_qkv(x, self.bases(), adapters, q.scale, backend=backend)
            self._x, self._pending = x, dict(enumerate(outs))
            for m in self.layers:
                m.last_backend = f"{backend}-fused-qkv"
        out = self._pending.pop(role)
        if not self._pending:
            self._x = None  # all three taken: hold no reference to the input
        return out


def fuse_lora(model: nn.Module, parts: tuple[str, ...] | list[str] | str) -> dict[str, list[str]]:
    """Route ``parts`` of an injected model through the fused paths; return {part: [module paths fused]}."""
    parts = (parts,) if isinstance(parts, str) else tuple(parts)
    unknown = [p for p in parts if p not in FUSABLE]
    if unknown or not parts:
        raise FuseError(f"fuse={list(parts)}: expected one or more of {FUSABLE}")
    done: dict[str, list[str]] = {p: [] for p in parts}
    modules = list(model.named_modules())
    if "mlp" in parts:
        for name, module in modules:
            if all(hasattr(module, n) for n in MLP_PARTS):
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, LoRAMLP(module, name))
                done["mlp"].append(name)
    if "qkv" in parts:
        for name, module in modules:
            if all(hasattr(module, n) for n in QKV_PARTS):
                layers = {n: getattr(module, n) for n in QKV_PARTS}
                _require(name, "qkv", layers)
                group = QKVGroup(tuple(layers.values()))
                for layer in layers.values():
                    layer.fused_group = group
                done["qkv"].append(name)
    if "o" in parts:
        done["o"] = [n for n, m in modules if n.rsplit(".", 1)[-1] == "o_proj" and isinstance(m, LoRALinear)]
    empty = [p for p, names in done.items() if not names]
    if empty:
        raise FuseError(
            f"fuse={empty} matched nothing in {type(model).__name__}: the MLP needs {list(MLP_PARTS)}, the "
            f"attention {list(QKV_PARTS)}, and o {['o_proj']} as LoRA targets"
        )
    return done
