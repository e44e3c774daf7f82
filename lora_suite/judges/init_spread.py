"""The adapters as ``inject`` makes them: A drawn from PEFT's default distribution, B zero.

PEFT's ``init_lora_weights=True`` (and loralib, torchtune, lora_core alike) draws A with
``kaiming_uniform_(a=√5)``: gain g = √(2 / (1 + a²)) = 1/√3, bound g·√(3 / in) = 1/√in, so every element of
z = A·√in is uniform on [−1, 1]: |z| ≤ 1, mean 0, standard deviation 1/√3, and B = 0 (the LoRA paper's §4.1: ΔW = 0 at
the start). Any random A gives a correct function at step 0 (INIT and INIT-LEARN judge that), so a wrong spread
passes every function check and changes only how training goes, against the reference it is compared with:
``lora-suite mutate`` left such mutants alive in the example (the init's spread).

Judged (``initial_spread``) on a probe of wide layers (every A together: n = 7·r·in ≥ 50,000 elements, so the
sample's standard deviation is within 0.2% of 1/√3 at one sigma; the bound below is 10 of them): every |z| ≤ 1 (one
rounding of the adapters' dtype over), the pooled mean within 4 standard errors of 0, the pooled standard deviation
within ``SPREAD_TOL`` of 1/√3, each layer's largest |z| at least 0.9 (the draw reaches its bound: r·in ≥ 4096 draws
all below 0.9 has probability 0.9⁴⁰⁹⁶), every B zero. The seed is fixed, so the verdict is the same on every run.
"""

from __future__ import annotations

import math

import torch

from lora_suite.engine import probes as P
from lora_suite.implementations import AdapterSpec, LoRAImplementation
from lora_suite.judges.layer_checks import none_of
from lora_suite.measure.criteria import Verdict

SHAPE = P.BlockShape("init", 512, 512, 256, 512)
R = 16
SPREAD_TOL = 0.02  # relative, on the pooled standard deviation: 10 standard errors at n = 7·16·(256..512)
SOURCE = (
    "PEFT init_lora_weights=True: A kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0; "
    "LoRA (arXiv 2106.09685) §4.1; lora_suite/judges/init_spread.py"
)


def initial_spread(impl: LoRAImplementation, device, dtype: torch.dtype = torch.float32, seed: int = 0) -> Verdict:
    """The module docstring's checks on ``impl``'s adapters as ``inject`` made them (``build_probe(randomise=False)``)."""
    quantize = "nf4" if impl.reason_not_applicable("bf16_base") else None
    spec = AdapterSpec(P.PROBE_TARGETS, R, 2.0 * R, False, torch.float32, quantize)
    probe = P.build_probe(impl, SHAPE, spec, dtype, device, seed=seed, randomise=False)
    bad, pooled = [], []
    for name, p in probe.adapters.items():
        t = p.detach().double()
        if name.endswith(".lora_B"):
            if bool((t != 0).any()):
                bad.append(f"{name}: {int((t != 0).sum())} non-zero elements (B starts at zero)")
            continue
        z = t * math.sqrt(t.shape[1])
        over = 1.0 + 2.0 * float(torch.finfo(p.dtype).eps)
        if float(z.abs().max()) > over:
            bad.append(f"{name}: max|A|·√in = {float(z.abs().max()):.4f} > 1")
        if float(z.abs().max()) < 0.9:
            bad.append(f"{name}: max|A|·√in = {float(z.abs().max()):.4f} < 0.9 (the draw never nears its bound)")
        pooled.append(z.flatten())
    if pooled:
        z = torch.cat(pooled)
        n, want = z.numel(), 1 / math.sqrt(3)
        mean, std = float(z.mean()), float(z.std())
        if abs(mean) > 4 * want / math.sqrt(n):
            bad.append(f"mean of A·√in = {mean:.5f}, beyond 4 standard errors of 0 (n = {n})")
        if abs(std / want - 1) > SPREAD_TOL:
            bad.append(f"std of A·√in = {std:.5f}, not 1/√3 = {want:.5f} within {SPREAD_TOL:.0%} (n = {n})")
    return none_of(
        f"at initialisation: A not U(±1/√in) or B not zero (PEFT's default init; of {len(probe.adapters)} tensors)",
        bad,
        SOURCE,
    )
