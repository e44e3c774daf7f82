"""``LoRALinear``: a frozen linear layer plus a trainable low-rank update, ``y = x Wᵀ + b + s·(x Aᵀ) Bᵀ``.

With ``quantize="nf4"`` (QLoRA) the base weight is stored as NF4 (``lora_core.nf4``) in buffers
``weight_packed`` / ``weight_absmax*``, and ``weight`` is None; ``NF4Linear`` is the same frozen NF4
base without adapters, for the linears that are not LoRA targets.

Parameter names: the base keeps ``weight`` (and ``bias``) so that a checkpoint of the original model
still loads into an injected one; the adapters are ``lora_A`` (r, in) and ``lora_B`` (out, r).
Initialisation follows PEFT: A kaiming-uniform (a = √5, as ``nn.Linear``), B zeros, so an injected
model starts exactly at its base. Scale s = alpha / r, or alpha / √r with ``use_rslora`` (rsLoRA).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import nn

from lora_core.backend import resolve_backend, validate_backend_name
from lora_core.nf4 import NF4Tensor, quantize_nf4
from lora_core.ops.lora_linear import lora_linear, nf4_linear


class FusedGroup(Protocol):
    """What a layer hands its forward to when it is computed with its siblings (``lora_core.fuse.QKVGroup``): the
    group's output for this layer's input. A protocol, so that the layer does not import the module that fuses it."""

    def __call__(self, layer: LoRALinear, x: torch.Tensor) -> torch.Tensor: ...


QUANTIZE_MODES = (None, "nf4")


def lora_scale(r: int, alpha: float, use_rslora: bool = False) -> float:
    """s = alpha / r (LoRA), or alpha / √r (rsLoRA, Kalajdzievski 2023)."""
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"r={r!r} must be a positive integer")
    if not math.isfinite(alpha):
        raise ValueError(f"alpha={alpha!r} must be finite")
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def _nf4_of(linear: nn.Linear) -> NF4Tensor:
    """The NF4 weight of ``linear``: read as it is from a bitsandbytes 4-bit layer (its weight carries a
    ``quant_state``, as in a model loaded with transformers' ``BitsAndBytesConfig``), else quantised here."""
    state = getattr(linear.weight, "quant_state", None)
    if state is not None:
        from lora_core.bnb_format import from_bnb

        return from_bnb(linear.weight.data, state)
    return quantize_nf4(linear.weight.detach())


class _NF4Storage(nn.Module):
    """Keeps an NF4Tensor in registered buffers (so .to(), state_dict and memory accounting see it)."""

    # The buffers _store_nf4 registers (declared for type checkers: nn.Module serves them through __getattr__).
    weight_packed: torch.Tensor
    weight_absmax: torch.Tensor | None
    weight_absmax_q: torch.Tensor | None
    weight_absmax_scale: torch.Tensor | None
    weight_absmax_code: torch.Tensor | None
    _nf4_meta: tuple[tuple[int, ...], torch.dtype, int, float]

    def _store_nf4(self, q: NF4Tensor) -> None:
        self.register_buffer("weight_packed", q.packed)
        self.register_buffer("weight_absmax", q.absmax)
        self.register_buffer("weight_absmax_q", q.absmax_q)
        self.register_buffer("weight_absmax_scale", q.absmax_scale)
        self.register_buffer("weight_absmax_code", q.absmax_code)  # set for a weight read from bitsandbytes
        self._nf4_meta = (q.shape, q.dtype, q.blocksize, q.absmax_mean)

    @property
    def nf4(self) -> NF4Tensor | None:
        if getattr(self, "_nf4_meta", None) is None:
            return None
        shape, dtype, blocksize, mean = self._nf4_meta
        return NF4Tensor(
            self.weight_packed,
            shape,
            dtype,
            blocksize,
            self.weight_absmax,
            self.weight_absmax_q,
            self.weight_absmax_scale,
            mean,
            self.weight_absmax_code,
        )

    def nf4_base(self) -> NF4Tensor:
        """``nf4`` of a layer that stores its base in NF4: an NF4Linear, or a LoRALinear with quantize="nf4"."""
        q = self.nf4
        assert q is not None, f"{type(self).__name__} stores no NF4 base"  # the callers check quantize first
        return q


class LoRALinear(_NF4Storage, nn.Module):
    """A frozen base (``weight`` (out, in), optional ``bias``) with trainable ``lora_A``, ``lora_B``.

    Built from base tensors, which are shared (not copied) and frozen; ``from_linear`` wraps an
    ``nn.Linear``. ``adapter_dtype`` defaults to fp32 (PEFT's default, good for AdamW); None means the
    base dtype (an fp64 base always keeps fp64 adapters, for reference runs).
    """

    def __init__(
        self,
        weight: torch.Tensor | NF4Tensor,
        bias: torch.Tensor | None = None,
        r: int = 8,
        alpha: float = 16,
        *,
        use_rslora: bool = False,
        backend: str | None = None,
        adapter_dtype: torch.dtype | None = torch.float32,
        quantize: str | None = None,
    ):
        super().__init__()
        if quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize={quantize!r} is not one of {QUANTIZE_MODES}")
        if isinstance(weight, NF4Tensor):  # already NF4 (e.g. read from bitsandbytes)
            if quantize != "nf4":
                raise ValueError(f"weight is an NF4Tensor but quantize={quantize!r}: pass quantize='nf4'")
            if len(weight.shape) != 2:
                raise ValueError(f"NF4 weight has shape {weight.shape}, expected (out_features, in_features)")
        elif not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(
                f"weight must be a 2-D tensor (out_features, in_features) or an NF4Tensor, got "
                f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}"
            )
        self.out_features, self.in_features = weight.shape
        self.r, self.alpha, self.use_rslora = r, alpha, use_rslora
        self.scale = lora_scale(r, alpha, use_rslora)
        self.backend = validate_backend_name(backend)  # requested: "cupy", "torch" or None (auto)
        self.last_backend: str | None = None  # the path that served the latest forward ("cupy", "cupy-fused-qkv")
        # a lora_core.fuse.QKVGroup that computes this layer with its siblings, or None
        self.fused_group: FusedGroup | None = None
        self.quantize = quantize
        self.weight: nn.Parameter | None
        if isinstance(weight, NF4Tensor):  # quantize is "nf4" (checked above)
            self.weight = None
            self._store_nf4(weight)
        elif quantize == "nf4":
            self.weight = None
            self._store_nf4(quantize_nf4(weight.detach()))
        else:
            self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        if adapter_dtype is None or weight.dtype == torch.float64:
            adapter_dtype = weight.dtype
        device = weight.device
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, device=device, dtype=adapter_dtype))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, r, device=device, dtype=adapter_dtype))
        self.reset_lora_parameters()

    def dense_weight(self) -> nn.Parameter:
        """``weight`` of a layer whose base is not NF4 (quantize None: ``weight`` is then always set)."""
        assert self.weight is not None, "an NF4 LoRALinear has no dense weight"  # the callers check quantize first
        return self.weight

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        r: int = 8,
        alpha: float = 16,
        backend: str | None = None,
        *,
        use_rslora: bool = False,
        adapter_dtype: torch.dtype | None = torch.float32,
        quantize: str | None = None,
    ) -> LoRALinear:
        """Wrap an existing ``nn.Linear``: its weight and bias are shared (not copied) and frozen.

        ``quantize="nf4"`` stores the weight as NF4 instead (the 16-bit one is then no longer referenced); a
        bitsandbytes ``Linear4bit`` keeps its own codes and state (``lora_core.bnb_format``), not quantised again.
        """
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        weight: torch.Tensor | NF4Tensor = linear.weight
        if getattr(linear.weight, "quant_state", None) is not None:  # a bitsandbytes 4-bit layer
            if quantize != "nf4":
                raise ValueError(
                    f"{type(linear).__name__} holds a bitsandbytes 4-bit weight, but quantize="
                    f"{quantize!r}: pass quantize='nf4' to keep it as it is"
                )
            weight = _nf4_of(linear)
        return cls(
            weight,
            linear.bias,
            r,
            alpha,
            use_rslora=use_rslora,
            backend=backend,
            adapter_dtype=adapter_dtype,
            quantize=quantize,
        )

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_group is not None:
            return self.fused_group(self, x)
        self.last_backend = resolve_backend(self.backend, x.device)
        weight = self.nf4_base() if self.quantize == "nf4" else self.dense_weight()
        y = lora_linear(x, weight, self.lora_A, self.lora_B, self.scale, backend=self.last_backend)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
            f"alpha={self.alpha}, scale={self.scale:g}, rslora={self.use_rslora}, "
            f"bias={self.bias is not None}, backend={self.backend or 'auto'}"
            f"{', quantize=' + self.quantize if self.quantize else ''}"
        )


class NF4Linear(_NF4Storage, nn.Module):
    """A frozen linear layer stored in NF4 (QLoRA's non-adapted projections): y = x Ŵᵀ (+ b)."""

    def __init__(self, linear: nn.Linear, backend: str | None = None):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"NF4Linear expects an nn.Linear, got {type(linear).__name__}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.backend = validate_backend_name(backend)
        self.last_backend: str | None = None
        self._store_nf4(_nf4_of(linear))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_backend = resolve_backend(self.backend, x.device)
        y = nf4_linear(x, self.nf4_base(), backend=self.last_backend)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, nf4, backend={self.backend or 'auto'}"
        )
