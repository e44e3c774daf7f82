"""bitsandbytes' NF4 storage, read into an ``NF4Tensor`` and written back without quantising anything again.

What bitsandbytes stores for ``quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)``
(the form of ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True)``, i.e. QLoRA as people run it):

    packed   uint8 (n/2, 1): two codes per byte, element 2j in the high nibble (NF4Tensor's order; lora_core's
             quantisation writes byte-identical codes)
    absmax   fp32 (n/64,), or, nested ("double quant"), uint8 (n/64,) codes q_b with
             offset μ (an fp32 scalar) and state2 = (absmax2 fp32 per 256 absmaxes, code2: a 256-entry fp32
             dynamic map, blocksize 256):
                 absmax_b = code2[q_b] · absmax2_{⌊b/256⌋} + μ        (an fp32 multiply, then an fp32 add)
    code     the 16 NF4 values (``quant_map``), dtype and shape of the original weight
    ŵ_i = code[c_i] · absmax_{⌊i/64⌋}, rounded once to the weight's dtype

Serialised (the state dict transformers saves for a ``Linear4bit``), under a prefix such as ``…q_proj.weight``:
``<prefix>`` (the packed codes), ``<prefix>.absmax``, ``<prefix>.quant_map``, ``<prefix>.nested_absmax``,
``<prefix>.nested_quant_map`` and ``<prefix>.quant_state.bitsandbytes__nf4`` (uint8 bytes of a JSON object with
quant_type, blocksize, dtype, shape, nested_blocksize, nested_dtype, nested_offset).

``nf4_weights(state_dict)`` reads every 4-bit weight of a model's state dict (module path -> NF4Tensor), to build
``LoRALinear(nf4_tensor, bias, r, alpha, quantize="nf4")`` layers on the checkpoint's own codes.
``from_bnb(packed, quant_state)`` takes a live ``bitsandbytes.functional.QuantState`` (read by attribute: this
module never imports bitsandbytes) or such a state dict; ``to_bnb_state_dict(q, prefix)`` writes the state dict.
An NF4Tensor quantised by lora_core itself double-quantises its absmaxes linearly (``lora_core.nf4``), which
bitsandbytes cannot read: it is written with fp32 absmaxes (not nested), from which bitsandbytes dequantises
the same weights bit for bit; nothing is quantised again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from lora_core.nf4 import BLOCKSIZE, DQ_BLOCKSIZE, NF4_CODE, NF4Tensor

QS_KEY = "quant_state.bitsandbytes__nf4"
_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BnbFormatError(ValueError):
    """A bitsandbytes weight or quantisation state lora_core cannot hold as it is (named, with what is expected)."""


def _dtype(name: Any, what: str) -> torch.dtype:
    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise BnbFormatError(f"{what} {name!r} is not one of {sorted(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[name]


def _unpack_json(t: torch.Tensor) -> dict:
    try:
        return json.loads(bytes(t.to("cpu", torch.uint8).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BnbFormatError(f"{QS_KEY}: not the JSON bytes bitsandbytes writes ({exc})") from None


def _fields(quant_state: Any) -> dict:
    """The state as plain fields, from a QuantState object or a (prefixed or not) serialised state dict."""
    if isinstance(quant_state, Mapping):
        by_leaf = {}
        for key, value in quant_state.items():
            leaf = key.split("quant_state.")[-1] if "quant_state." in key else key.rsplit(".", 1)[-1]
            by_leaf["quant_state" if leaf.startswith("bitsandbytes__") else leaf] = value
        if "quant_state" in by_leaf:
            qs_keys = [k for k in quant_state if "quant_state.bitsandbytes__" in k]
            if any(not k.endswith(QS_KEY) for k in qs_keys):
                raise BnbFormatError(f"quant_state keys {qs_keys}: only {QS_KEY!r} (NF4) is supported, not FP4")
            by_leaf.update(_unpack_json(by_leaf.pop("quant_state")))
        missing = [k for k in ("absmax", "quant_map", "blocksize", "dtype", "shape", "quant_type") if k not in by_leaf]
        if missing:
            raise BnbFormatError(f"bitsandbytes quant state lacks {missing}; got keys {sorted(quant_state)}")
        f = {
            "quant_type": by_leaf["quant_type"],
            "absmax": by_leaf["absmax"],
            "code": by_leaf["quant_map"],
            "blocksize": by_leaf["blocksize"],
            "dtype": by_leaf["dtype"],
            "shape": by_leaf["shape"],
            "nested": False,
        }
        if "nested_absmax" in by_leaf:
            f.update(
                nested=True,
                absmax2=by_leaf["nested_absmax"],
                code2=by_leaf["nested_quant_map"],
                blocksize2=by_leaf.get("nested_blocksize"),
                offset=by_leaf.get("nested_offset"),
            )
        return f
    try:
        f = {
            "quant_type": quant_state.quant_type,
            "absmax": quant_state.absmax,
            "code": quant_state.code,
            "blocksize": quant_state.blocksize,
            "dtype": quant_state.dtype,
            "shape": quant_state.shape,
            "nested": bool(quant_state.nested),
        }
        if f["nested"]:
            f.update(
                absmax2=quant_state.state2.absmax,
                code2=quant_state.state2.code,
                blocksize2=quant_state.state2.blocksize,
                offset=quant_state.offset,
            )
    except AttributeError as exc:
        raise BnbFormatError(
            f"quant_state of type {type(quant_state).__name__} is neither a bitsandbytes "
            f"QuantState nor its state dict ({exc})"
        ) from None
    return f


def from_bnb(packed: torch.Tensor, quant_state: Any) -> NF4Tensor:
    """An NF4Tensor holding bitsandbytes' packed codes and state as they are (see the module docstring).

    Refused, naming the value: another quant type than nf4, a block size other than 64 (lora_core's kernels) or a
    nested block size other than 256, a quant map that is not the NF4 code, a dtype lora_core cannot dequantise
    to, and sizes that do not fit the shape."""
    f = _fields(quant_state)
    if f["quant_type"] != "nf4":
        raise BnbFormatError(f"quant_type {f['quant_type']!r}: only 'nf4' is supported")
    if int(f["blocksize"]) != BLOCKSIZE:
        raise BnbFormatError(f"blocksize {f['blocksize']}: lora_core's NF4 kernels use {BLOCKSIZE}")
    dtype = _dtype(f["dtype"], "dtype")
    shape = tuple(int(d) for d in f["shape"])
    if len(shape) != 2:
        raise BnbFormatError(f"shape {shape}: expected a 2-D weight (out_features, in_features)")
    n = shape[0] * shape[1]
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.numel() * 2 != n:
        raise BnbFormatError(
            f"packed codes {getattr(packed, 'dtype', type(packed).__name__)} with "
            f"{getattr(packed, 'numel', lambda: '?')()} bytes: expected uint8 with {n // 2} bytes "
            f"for shape {shape}"
        )
    code = torch.as_tensor(f["code"]).to("cpu", torch.float32)
    if not torch.equal(code, torch.tensor(NF4_CODE, dtype=torch.float32)):
        raise BnbFormatError(f"quant_map {code.tolist()[:4]}…: not the NF4 code lora_core dequantises with")
    device = packed.device
    absmax = torch.as_tensor(f["absmax"]).to(device)
    if absmax.numel() != n // BLOCKSIZE:
        raise BnbFormatError(f"absmax has {absmax.numel()} values, expected {n // BLOCKSIZE} for shape {shape}")
    packed = packed.reshape(-1).contiguous()
    if not f["nested"]:
        if absmax.dtype != torch.float32:
            raise BnbFormatError(f"absmax dtype {absmax.dtype}: a state that is not nested holds fp32 absmaxes")
        return NF4Tensor(packed, shape, dtype, BLOCKSIZE, absmax.contiguous(), None, None, 0.0)
    if int(f["blocksize2"]) != DQ_BLOCKSIZE:
        raise BnbFormatError(f"nested blocksize {f['blocksize2']}: expected {DQ_BLOCKSIZE}")
    if absmax.dtype != torch.uint8:
        raise BnbFormatError(f"nested absmax codes of dtype {absmax.dtype}: expected uint8")
    absmax2 = torch.as_tensor(f["absmax2"]).to(device, torch.float32).contiguous()
    code2 = torch.as_tensor(f["code2"]).to(device, torch.float32).contiguous()
    if code2.numel() != 256 or absmax2.numel() != -(-absmax.numel() // DQ_BLOCKSIZE):
        raise BnbFormatError(
            f"nested state: quant map of {code2.numel()} values (expected 256), {absmax2.numel()} "
            f"scales (expected {-(-absmax.numel() // DQ_BLOCKSIZE)})"
        )
    offset = float(torch.as_tensor(f["offset"], dtype=torch.float32))  # fp32 value, exact in a Python float
    return NF4Tensor(packed, shape, dtype, BLOCKSIZE, None, absmax.contiguous(), absmax2, offset, code2)


def to_bnb_state_dict(q: NF4Tensor, prefix: str = "weight") -> dict[str, torch.Tensor]:
    """The state dict transformers writes for a bitsandbytes ``Linear4bit`` weight, from ``q`` as it is.

    A state read from bitsandbytes goes back nested, byte for byte; lora_core's own linear double quantisation
    has no bitsandbytes form and goes out with fp32 absmaxes (exact, 4 bytes per 64 weights instead of ~1)."""
    meta = {
        "quant_type": "nf4",
        "blocksize": q.blocksize,
        "dtype": str(q.dtype).removeprefix("torch."),
        "shape": list(q.shape),
    }
    out = {
        prefix: q.packed.reshape(-1, 1),
        f"{prefix}.quant_map": torch.tensor(NF4_CODE, dtype=torch.float32, device=q.device),
    }
    if q.absmax_code is not None:
        absmax_q, absmax_scale = q.double_quant_state()  # bitsandbytes' form is always double-quantised
        out[f"{prefix}.absmax"] = absmax_q
        out[f"{prefix}.nested_absmax"] = absmax_scale
        out[f"{prefix}.nested_quant_map"] = q.absmax_code.clone()
        meta.update(nested_blocksize=DQ_BLOCKSIZE, nested_dtype="float32", nested_offset=q.absmax_mean)
    else:
        out[f"{prefix}.absmax"] = q.block_absmax().contiguous()
    out[f"{prefix}.{QS_KEY}"] = torch.tensor(list(json.dumps(meta).encode("utf-8")), dtype=torch.uint8)
    return out


def from_bnb_state_dict(state: Mapping[str, torch.Tensor], prefix: str = "weight") -> NF4Tensor:
    """``from_bnb`` on the entries of ``state`` under ``prefix`` (a transformers state dict of a 4-bit model)."""
    if prefix not in state:
        raise BnbFormatError(f"no packed weight {prefix!r} in the state dict (keys like {sorted(state)[:4]})")
    entries = {k: v for k, v in state.items() if k.startswith(prefix + ".")}
    return from_bnb(state[prefix], entries)


def nf4_weights(state: Mapping[str, torch.Tensor]) -> dict[str, NF4Tensor]:
    """Module path -> NF4Tensor for every bitsandbytes NF4 weight in a (transformers) state dict."""
    marker = f".weight.{QS_KEY}"
    paths = [k[: -len(marker)] for k in state if k.endswith(marker)]
    if not paths:
        fp4 = [k for k in state if k.endswith(".quant_state.bitsandbytes__fp4")]
        raise BnbFormatError(
            f"no bitsandbytes NF4 weight in the state dict ({len(state)} keys"
            f"{'; FP4 weights, which are not supported: ' + str(fp4[:2]) if fp4 else ''})"
        )
    return {path: from_bnb_state_dict(state, prefix=f"{path}.weight") for path in paths}
