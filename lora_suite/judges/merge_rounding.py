"""The merged weight, element by element: W' = W + s·B·A rounded once to the weight's dtype, never a delta rounded to
16 bits that the adapters did not hold in 16 bits.

Why an element check: the merged-outputs checks compare a merged block's outputs with the float64 function within the
parity tolerance of its dtype, where one extra rounding of the delta hides (bf16's tolerance is 0.031 of the largest
output). PEFT's own merge reports (peft#1388: merged bf16 weights not equal to W + BA, the eval loss moved) are that
extra rounding. Read exactly, the merged weight tells it apart.

Reading W' through the contract: after ``merge_adapters`` every adapter tensor the model still holds is zeroed, and
each merged projection is given the identity matrix I (K x K): its output is I·W'ᵀ, each element one weight times 1
plus zeros, exact in any dtype (a bias-free block only: a bias would add a rounding).

The bound, per element, with E = W + s·B·A in float64 (B, A as the adapters hold them, in their own dtype):

    |W' − E| ≤ ulp_w(E)                          one rounding to the weight dtype, with room for a second
             + s·(½·ulp_a(B·A) + r·u_a·|B|·|A|) + ½·ulp_a(s·B·A)
                                                  (16-bit adapters only) the delta formed in the adapters' own dtype
                                                  as PEFT does on a GPU: B·A by a 16-bit GEMM (cuBLAS may reduce its
                                                  partial sums in 16 bits: the r-term bound r·u_a), rounded, then
                                                  times s and rounded again
             + 2·(r+2)·u_fp32·(|W| + s·|B|·|A|)   the delta's fp32 accumulation over r products and the addition

where ulp_t(v) is the spacing of dtype t at |v| (2^(e−p) for |v| in [2^(e−1), 2^e), p the significand bits; the
subnormal spacing at zero). A merge that rounds an fp32 delta to 16 bits, or forms it from adapters cast to 16 bits,
is off by ½·ulp_16(δ): many ulps of W' wherever W and δ nearly cancel (|W'| ≪ |δ|), which random W and δ of one
scale give in a few percent of the elements.
"""

from __future__ import annotations

import torch

from lora_suite.engine import probes as P
from lora_suite.measure.criteria import Verdict

U32 = 2.0**-24
SOURCE = (
    "|W' - (W + s·B·A)| <= ulp_w + s(½ulp_a(B·A) + r·u_a|B||A|) + ½ulp_a(s·B·A) (16-bit adapters) "
    "+ 2(r+2)·u_fp32·(|W|+s|B||A|); "
    "merge_rounding.py"
)


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each of ``values`` (float64): 2^(e−p) where |v| = m·2^e, m in [½, 1)."""
    info = torch.finfo(dtype)
    p = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}[dtype]
    _, e = torch.frexp(values.abs())
    spacing = torch.pow(2.0, (e - p).double())
    spacing = torch.where(values == 0, torch.zeros_like(spacing), spacing)  # frexp(0) has no exponent to read
    return torch.clamp(spacing, min=info.tiny * info.eps)


def read_merged(probe: P.Probe) -> dict[str, torch.Tensor]:
    """Each adapted projection's merged weight (out, in), read through the merged block (see the module docstring);
    every adapter tensor left on the model is zeroed first."""
    if probe.biases:
        raise ValueError(f"read_merged: probe {probe.shape.name!r} has biases; the identity read needs none")
    with torch.no_grad():
        for p in probe.impl.adapter_parameters(probe.block).values():
            p.zero_()
        out = {}
        for path in probe.adapted:
            k = probe.weights[path].shape[1]
            eye = torch.eye(k, device=probe.weights[path].device, dtype=probe.dtype)
            out[path] = P._call_alone(probe.block, path, eye).T.contiguous()
    return out


def element_bounds(probe: P.Probe, adapters: dict[str, torch.Tensor], path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, bound) of one projection: the exact merged weight and each element's allowed error."""
    w = probe.weights[path].double()
    a, b = adapters[f"{path}.lora_A"], adapters[f"{path}.lora_B"]
    s, r = probe.scale_at(path), a.shape[0]
    product, magnitude = b.double() @ a.double(), b.double().abs() @ a.double().abs()
    delta = s * product
    exact = w + delta
    bound = ulp(exact, probe.dtype) + 2 * (r + 2) * U32 * (w.abs() + s * magnitude)
    if a.dtype != torch.float32:  # PEFT's merge of 16-bit adapters: B·A in their dtype, then s·(B·A) rounded again
        u_a = 0.5 * float(torch.finfo(a.dtype).eps)
        bound = bound + s * (0.5 * ulp(product, a.dtype) + r * u_a * magnitude) + 0.5 * ulp(delta, a.dtype)
    return exact, bound


def merged_rounding(probe: P.Probe) -> Verdict:
    """Merge ``probe`` (in place: use it last) and judge every element of every merged weight (module docstring)."""
    adapters = {n: p.detach().clone() for n, p in probe.adapters.items()}
    probe.impl.merge_adapters(probe.block)
    merged = read_merged(probe)
    bad, total = [], 0
    for path, got in merged.items():
        exact, bound = element_bounds(probe, adapters, path)
        err = (got.double() - exact).abs()
        over = err > bound
        total += err.numel()
        if over.any():
            i = int((err / bound).argmax())
            where = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), err.shape))
            bad.append(
                f"{path}: {int(over.sum())} elements, worst at {where}: merged {float(got.flatten()[i]):.9g}, "
                f"W + s·B·A {float(exact.flatten()[i]):.9g}, error {float(err.flatten()[i]):.3g} > "
                f"bound {float(bound.flatten()[i]):.3g}"
            )
    return Verdict(
        f"merged weights: projections with elements not W + s·B·A rounded once (of {len(merged)}, {total} elements)",
        len(bad),
        "==",
        0,
        SOURCE,
        "; ".join(bad[:3]),
    )
