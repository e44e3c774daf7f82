"""NF4 (4-bit NormalFloat) storage of frozen base weights, as in QLoRA (Dettmers et al. 2023).

Quantisation of a weight w (any shape, flattened row-major, n elements, n a multiple of the block size):
    absmax_b = max_{i in block b} |w_i|                               one fp32 per block of 64
    x_i      = w_i · (1 / absmax_b)   (0 when absmax_b = 0)           fp32, reciprocal-multiply as bitsandbytes
    code_i   = #{k : x_i > m_k},  m_k = (c_k + c_{k+1}) / 2 in fp32     nearest NF4 value, ties to the lower
    packed_j = code_{2j} << 4 | code_{2j+1}                           bitsandbytes' nibble order
Double quantisation of the absmaxes (``double_quant=True``):
    μ = mean(absmax);  per block g of 256: s_g = max |absmax − μ|;  q = rint((absmax − μ) / s_g · 127) as int8
    absmax ≈ q · s_g / 127 + μ          (4 + 8/64 + 32/(64·256) ≈ 4.127 bits per parameter)
bitsandbytes' double quantisation (an NF4Tensor read by ``lora_core.bnb_format``, ``absmax_code`` set):
    absmax ≈ d[q] · s_g + μ,  q uint8, d bitsandbytes' 256-entry dynamic map (fp32 multiply, then fp32 add)
Dequantisation: ŵ_i = c[code_i] · absmax_b, in the requested dtype.

Sizes that are not a multiple of the block size raise ValueError (no silent padding): every Llama
projection (multiples of 64 in both dimensions) qualifies. Error bound of the round trip, per element:
|w − ŵ| ≤ absmax_b · (max gap between neighbouring codes / 2 + δ), with δ the double-quantisation error
of the absmax relative to it (≤ s_g / (254 · absmax_b)); the largest code gap is −0.6962 − (−1) = 0.3038.

GPU quantise/dequantise are the RawKernels of ``kernels/nf4.cu``; ``quantize_nf4_reference`` and
``dequantize_nf4_reference`` are the plain-torch reference they are tested against (CPU or GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lora_core.ops import cupy_interop as cx
from lora_core.ops import kernel_variants as kv

NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
MAX_CODE_GAP = max(b - a for a, b in zip(NF4_CODE, NF4_CODE[1:]))  # 0.3038 (between -1.0 and -0.6962)
BLOCKSIZE = 64
DQ_BLOCKSIZE = 256
_KERNEL_NAMES = (
    tuple(f"nf4_quantize<{t}>" for t in ("float", "__nv_bfloat16", "__half"))
    + tuple(f"nf4_dequantize<{t}>" for t in ("float", "__nv_bfloat16", "__half"))
    + ("absmax_quantize",)
)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class NF4Tensor:
    """A quantised weight: packed codes plus the quantisation state needed to dequantise it."""

    packed: torch.Tensor  # uint8 (n / 2,): two codes per byte, element 2j in the high nibble
    shape: tuple[int, ...]  # the original weight's shape
    dtype: torch.dtype  # the original weight's dtype (the default dequantisation dtype)
    blocksize: int
    absmax: torch.Tensor | None  # fp32 (n / blocksize,) when not double-quantised
    absmax_q: torch.Tensor | None  # int8 (n / blocksize,) when double-quantised
    absmax_scale: torch.Tensor | None  # fp32 (ceil(n_blocks / 256),)
    absmax_mean: float  # μ (0.0 when not double-quantised)
    # bitsandbytes' dynamic map (fp32 (256,)) when the absmaxes are double-quantised its way: absmax_q is then
    # uint8 indices into it and absmax_scale its per-256 scales (lora_core.bnb_format); None: lora_core's int8 form
    absmax_code: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def double_quant(self) -> bool:
        return self.absmax_q is not None

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def state_nbytes(self) -> int:
        """Bytes of the quantisation state (absmaxes, their codes and scales), not counting the codes."""
        return sum(
            t.numel() * t.element_size()
            for t in (self.absmax, self.absmax_q, self.absmax_scale, self.absmax_code)
            if t is not None
        )

    def nbytes(self) -> int:
        return self.packed.numel() + self.state_nbytes()

    def double_quant_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(absmax_q, absmax_scale) of a double-quantised tensor: the two are always set together."""
        assert self.absmax_q is not None and self.absmax_scale is not None, "this NF4Tensor is not double-quantised"
        return self.absmax_q, self.absmax_scale

    def block_absmax(self) -> torch.Tensor:
        """fp32 absmax per block, recovered from the double quantisation when there is one."""
        if not self.double_quant:
            assert self.absmax is not None, "an NF4Tensor without double quantisation holds its absmax"
            return self.absmax
        absmax_q, absmax_scale = self.double_quant_state()
        scale = absmax_scale.repeat_interleave(DQ_BLOCKSIZE)[: absmax_q.numel()]
        if self.absmax_code is not None:  # bitsandbytes: d[q] · s, then + μ, two roundings as its kernels do
            return self.absmax_code[absmax_q.long()] * scale + torch.full_like(scale, self.absmax_mean)
        # Tensor-by-tensor IEEE ops only, in the kernel's order: torch may turn a division by a Python
        # scalar into a multiplication by its reciprocal (seen on the H200: 1090 of 64000 values off by an ulp).
        step = scale / torch.full_like(scale, 127.0)
        return absmax_q.float() * step + torch.full_like(step, self.absmax_mean)


def _check_weight(weight: torch.Tensor, blocksize: int) -> None:
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"quantize_nf4 expects a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(
            f"quantize_nf4 expects a 2-D weight (out_features, in_features), got shape {tuple(weight.shape)}"
        )
    if weight.dtype not in _DTYPES:
        raise ValueError(f"weight has dtype {weight.dtype}, expected one of {_DTYPES}")
    if blocksize != BLOCKSIZE:
        raise ValueError(f"blocksize={blocksize}: only {BLOCKSIZE} is implemented (the kernels use one warp per block)")
    if weight.numel() % blocksize:
        raise ValueError(
            f"weight of shape {tuple(weight.shape)} has {weight.numel()} elements, not a multiple of "
            f"the block size {blocksize}; NF4 here does not pad"
        )
    if not torch.isfinite(weight).all():
        bad = int((~torch.isfinite(weight)).sum())
        raise ValueError(f"weight of shape {tuple(weight.shape)} has {bad} non-finite value(s); NF4 cannot store them")


def _midpoints(device) -> torch.Tensor:
    code = torch.tensor(NF4_CODE, dtype=torch.float32, device=device)
    return (code[:-1] + code[1:]) * 0.5  # fp32, as the kernel computes them


def _double_quant(absmax: torch.Tensor):
    """(int8 codes, fp32 scale per 256, mean) of the absmaxes; the reference of ``absmax_quantize``."""
    mean = float(absmax.mean())
    centred = absmax - torch.tensor(mean, dtype=torch.float32, device=absmax.device)
    pad = (-centred.numel()) % DQ_BLOCKSIZE
    scale = torch.nn.functional.pad(centred.abs(), (0, pad)).view(-1, DQ_BLOCKSIZE).amax(dim=1)
    per_elem = scale.repeat_interleave(DQ_BLOCKSIZE)[: centred.numel()]
    q = torch.where(per_elem > 0, torch.round(centred / torch.where(per_elem > 0, per_elem, 1.0) * 127.0), 0.0)
    return q.to(torch.int8), scale, mean


def quantize_nf4_reference(weight: torch.Tensor, blocksize: int = BLOCKSIZE, double_quant: bool = True) -> NF4Tensor:
    """Plain-torch NF4 quantisation (the reference the RawKernels are checked against)."""
    _check_weight(weight, blocksize)
    blocks = weight.detach().reshape(-1, blocksize).float()  # (n_blocks, 64)
    absmax = blocks.abs().amax(dim=1)  # (n_blocks,)
    inv = torch.where(absmax > 0, 1.0 / torch.where(absmax > 0, absmax, 1.0), 0.0)
    x = blocks * inv[:, None]
    codes = (x.unsqueeze(-1) > _midpoints(weight.device)).sum(dim=-1).to(torch.uint8).reshape(-1)  # (n,)
    packed = (codes[0::2] << 4) | codes[1::2]
    return _finish(packed, absmax, weight, blocksize, double_quant, _double_quant)


def _finish(packed, absmax, weight, blocksize, double_quant, double_quant_fn) -> NF4Tensor:
    if double_quant:
        q, scale, mean = double_quant_fn(absmax)
        if not (math.isfinite(mean) and bool(torch.isfinite(scale).all())):
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} has values up to {float(absmax.max()):.3g}: the double "
                "quantisation of its block absmaxes (their mean and scales) overflows float32; scale the weight "
                "down or pass double_quant=False"
            )
        return NF4Tensor(packed, tuple(weight.shape), weight.dtype, blocksize, None, q, scale, mean)
    return NF4Tensor(packed, tuple(weight.shape), weight.dtype, blocksize, absmax, None, None, 0.0)


def dequantize_nf4_reference(q: NF4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    code = torch.tensor(NF4_CODE, dtype=torch.float32, device=q.device)
    hi, lo = (q.packed >> 4).long(), (q.packed & 0xF).long()
    values = torch.stack([code[hi], code[lo]], dim=1).reshape(-1, q.blocksize)  # (n_blocks, 64) fp32
    return (values * q.block_absmax()[:, None]).to(dtype or q.dtype).reshape(q.shape)


def quantize_nf4(weight: torch.Tensor, blocksize: int = BLOCKSIZE, double_quant: bool = True) -> NF4Tensor:
    """NF4-quantise ``weight``: RawKernels for CUDA tensors, the torch reference on the CPU."""
    if not (isinstance(weight, torch.Tensor) and weight.is_cuda):
        return quantize_nf4_reference(weight, blocksize, double_quant)
    _check_weight(weight, blocksize)
    w = weight.detach().contiguous()
    n_blocks = w.numel() // blocksize
    packed = torch.empty(w.numel() // 2, dtype=torch.uint8, device=w.device)
    absmax = torch.empty(n_blocks, dtype=torch.float32, device=w.device)
    warps_per_block = 8
    grid, block = (cx.ceil_div(n_blocks, warps_per_block),), (32 * warps_per_block,)
    kv.note("nf4_quantize", w.dtype, kv.last_cta(n_blocks, warps_per_block), grid, block)
    with cx.on_torch_stream(w.device) as cu:
        cu.launch(
            "nf4.cu",
            _KERNEL_NAMES,
            f"nf4_quantize<{cx.CUDA_TYPE_NAME[w.dtype]}>",
            grid,
            block,
            (w, packed, absmax, n_blocks),
        )
    return _finish(packed, absmax, weight, blocksize, double_quant, _double_quant_gpu)


def _double_quant_gpu(absmax: torch.Tensor):
    n = absmax.numel()
    mean = float(absmax.mean())  # one host sync per weight, at quantisation time only
    q = torch.empty(n, dtype=torch.int8, device=absmax.device)
    scale = torch.empty(cx.ceil_div(n, DQ_BLOCKSIZE), dtype=torch.float32, device=absmax.device)
    kv.note("absmax_quantize", "fp32", kv.last_cta(n, DQ_BLOCKSIZE), (scale.numel(),), (DQ_BLOCKSIZE,))
    with cx.on_torch_stream(absmax.device) as cu:
        cu.launch(
            "nf4.cu", _KERNEL_NAMES, "absmax_quantize", (scale.numel(),), (DQ_BLOCKSIZE,), (absmax, mean, q, scale, n)
        )
    return q, scale, mean


def dequantize_nf4(q: NF4Tensor, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantise into a torch-allocated tensor (``out`` if given): RawKernel on the GPU, reference on the CPU."""
    dtype = dtype or q.dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dequantize_nf4: dtype {dtype} is not one of {_DTYPES}")
    if not q.packed.is_cuda:
        ref = dequantize_nf4_reference(q, dtype)
        return ref if out is None else out.copy_(ref)
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    elif tuple(out.shape) != q.shape or out.dtype != dtype or not out.is_contiguous() or out.device != q.device:
        raise ValueError(
            f"out has shape {tuple(out.shape)} {out.dtype} on {out.device}, expected contiguous "
            f"{q.shape} {dtype} on {q.device}"
        )
    n8 = q.numel // 8  # work items of 8 elements
    block, items_per_thread = 256, 4  # items_per_thread is DEQ_ITEMS in kernels/nf4.cu
    null = 0  # a null pointer for the state the variant does not use
    grid = (cx.ceil_div(n8, block * items_per_thread),)
    form = "fp32" if q.absmax is not None else "dcode" if q.absmax_code is not None else "int8"
    kv.note("nf4_dequantize", dtype, f"absmax={form}, {kv.last_cta(n8, block * items_per_thread)}", grid, (block,))
    with cx.on_torch_stream(q.device) as cu:
        cu.launch(
            "nf4.cu",
            _KERNEL_NAMES,
            f"nf4_dequantize<{cx.CUDA_TYPE_NAME[dtype]}>",
            grid,
            (block,),
            (
                q.packed,
                q.absmax if q.absmax is not None else null,
                q.absmax_q if q.double_quant else null,
                q.absmax_scale if q.double_quant else null,
                float(q.absmax_mean),
                q.absmax_code if q.absmax_code is not None else null,
                out,
                n8,
            ),
        )
    return out


def roundtrip_error_bound(q: NF4Tensor) -> torch.Tensor:
    """Per-block bound on |w − ŵ|: absmax·MAX_CODE_GAP/2 plus the absmax's own double-quantisation error."""
    if q.absmax_code is not None:
        raise ValueError(
            "roundtrip_error_bound: this NF4Tensor holds bitsandbytes' double quantisation (absmax_code "
            "set); the bound is derived for lora_core's own int8 form only"
        )
    absmax = q.block_absmax()
    if not q.double_quant:
        return absmax * (MAX_CODE_GAP / 2) * (1 + 1e-6)
    _, absmax_scale = q.double_quant_state()
    scale = absmax_scale.repeat_interleave(DQ_BLOCKSIZE)[: absmax.numel()]
    true_absmax_bound = absmax + scale / 254  # the stored absmax is within s/254 of the true one
    return true_absmax_bound * (MAX_CODE_GAP / 2) + scale / 254 * 1.0 + 1e-6 * true_absmax_bound
