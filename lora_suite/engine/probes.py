"""Layer probes: one decoder block's projections, adapted through *any* implementation's ``inject``, run forward and
backward on random inputs; ``lora_suite.judges.probe_judge`` judges the run tensor by tensor against float64 computed
from the same base and adapter tensors.

The probe is the smallest model every implementation can take as it takes a Llama: a ``ProbeBlock`` with an
attention part (``self_attn`` holding q_proj, k_proj, v_proj, o_proj) and a SwiGLU MLP (``mlp`` holding gate_proj,
up_proj, down_proj and a SiLU ``act_fn``). Implementations that fuse a group (lora_core's cupy-fused, Axolotl's
kernels) find the groups they fuse; the others adapt seven plain linears. The adapters are read back through the
contract (``adapter_parameters``: ``<path>.lora_A`` (r, in), ``<path>.lora_B`` (out, r)) and filled with random
values (B non-zero, so that dA matters), the scale is the contract's s = alpha / r (alpha / √r with rsLoRA).

What runs (``run_probe``), with upstream gradients for every output:

    q, k, v = self_attn(x)            each p(x) = x Wₚᵀ + s·(x Aₚᵀ) Bₚᵀ
    o       = o_proj(x_o)
    m       = down(silu(gate(x_m)) ⊙ up(x_m))

For a 4-bit base the weights the reference uses are those the implementation itself multiplies with
(``effective_weight``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from lora_suite.implementations import AdapterSpec, LoRAImplementation

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROBE_TARGETS = ATTN + MLP  # named, not "all-linear": PEFT expands that shorthand only on transformers' models


@dataclass(frozen=True)
class BlockShape:
    """Widths of one probe block: hidden K, q (and o's input) width, k/v width, MLP intermediate width I; ``bias``:
    every projection carries a base bias b (then p(x) = x Wₚᵀ + bₚ + s·(x Aₚᵀ) Bₚᵀ, as Qwen2's q/k/v)."""

    name: str
    hidden: int
    q_out: int
    kv_out: int
    intermediate: int
    bias: bool = False


class Projections(nn.Module):
    """An attention's four projections; ``forward`` gives q, k, v of one input (how attention calls them)."""

    def __init__(self, shape: BlockShape, **kw):
        super().__init__()
        k, b = shape.hidden, shape.bias
        self.q_proj = nn.Linear(k, shape.q_out, bias=b, **kw)
        self.k_proj = nn.Linear(k, shape.kv_out, bias=b, **kw)
        self.v_proj = nn.Linear(k, shape.kv_out, bias=b, **kw)
        self.o_proj = nn.Linear(shape.q_out, k, bias=b, **kw)

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class SwiGLU(nn.Module):
    """A Llama MLP: down(silu(gate(x)) ⊙ up(x))."""

    def __init__(self, shape: BlockShape, **kw):
        super().__init__()
        b = shape.bias
        self.gate_proj = nn.Linear(shape.hidden, shape.intermediate, bias=b, **kw)
        self.up_proj = nn.Linear(shape.hidden, shape.intermediate, bias=b, **kw)
        self.down_proj = nn.Linear(shape.intermediate, shape.hidden, bias=b, **kw)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ProbeBlock(nn.Module):
    def __init__(self, shape: BlockShape, **kw):
        super().__init__()
        self.self_attn = Projections(shape, **kw)
        self.mlp = SwiGLU(shape, **kw)

    def forward(self, x, x_o, x_m):
        return (*self.self_attn(x), self.self_attn.o_proj(x_o), self.mlp(x_m))


OUTPUTS = ("q", "k", "v", "o", "mlp")
INPUTS = ("x", "x_o", "x_m")


@dataclass
class Probe:
    """A probe block adapted by ``impl``: its module, the base weights it was built with (module path -> W, the
    dtype it was built in; None for a 4-bit base until ``effective_weight`` reads them), the base biases (module
    path -> b; empty when the shape has none), the adapters (canonical names) and the scale every adapted layer
    applies."""

    impl: LoRAImplementation
    spec: AdapterSpec
    shape: BlockShape
    block: nn.Module
    weights: dict[str, torch.Tensor]
    adapters: dict[str, nn.Parameter]
    adapted: list[str]
    scale: float
    dtype: torch.dtype
    biases: dict[str, torch.Tensor] = field(default_factory=dict)

    def scale_at(self, path: str) -> float:
        """The scale the adapted layer at ``path`` applies: ``scale`` times its own over the spec's (1 unless the spec
        overrides its r or alpha: rank_pattern, alpha_pattern), so that a ``scale`` set in place of the spec's (the
        lifecycle's rescale) carries to every layer."""
        own = self.spec.scale_of(path.rsplit(".", 1)[-1])
        return self.scale * (own / spec_scale(self.spec))

    def run_names(self) -> list[str]:
        """The names ``ProbeRun.tensors`` gives, in order."""
        return list(OUTPUTS) + [f"d{n}" for n in INPUTS] + [f"d[{n}]" for n in self.adapters]


def spec_scale(spec: AdapterSpec) -> float:
    return spec.alpha / (math.sqrt(spec.r) if spec.use_rslora else spec.r)


def build_probe(
    impl: LoRAImplementation,
    shape: BlockShape,
    spec: AdapterSpec,
    dtype: torch.dtype,
    device,
    *,
    seed: int = 0,
    randomise: bool = True,
) -> Probe:
    """A ``ProbeBlock`` of random base weights (std 1/√in) in ``dtype`` adapted by ``impl`` per ``spec``, its
    adapters then set to random values (A std 1/√in, B std 1/√r) in their own dtype. With a 4-bit base
    (``spec.quantize``) the weights the reference uses are read from a twin built from the same seed
    (``effective_weight``), so that the probe under test has run nothing before the test runs it.
    ``randomise=False`` keeps the adapters as ``inject`` made them (the initial state is then what is judged)."""
    if spec.quantize is not None and shape.bias:
        raise ValueError(
            f"build_probe: shape {shape.name!r} has biases and quantize={spec.quantize!r}: the 4-bit "
            "probe reads its weights through the identity, which a bias would add to; use bias=False"
        )
    probe = _build(impl, shape, spec, dtype, device, seed, randomise)
    if spec.quantize is not None:
        twin = _build(impl, shape, spec, dtype, device, seed, randomise)
        probe.weights = {path: effective_weight(twin, path) for path in probe.weights}
    return probe


def _build(impl, shape, spec, dtype, device, seed: int, randomise: bool = True) -> Probe:
    gen = torch.Generator(device=device).manual_seed(seed)
    block = ProbeBlock(shape, device=device, dtype=dtype)
    weights, biases = {}, {}
    with torch.no_grad():
        for path, m in block.named_modules():
            if isinstance(m, nn.Linear):
                w = torch.randn(m.weight.shape, device=device, generator=gen) * m.in_features**-0.5
                m.weight.copy_(w.to(dtype))
                weights[path] = m.weight.detach().clone()
                if m.bias is not None:  # of the outputs' own scale (unit variance), so that a dropped bias shows
                    m.bias.copy_(torch.randn(m.bias.shape, device=device, generator=gen).to(dtype))
                    biases[path] = m.bias.detach().clone()
    torch.manual_seed(seed)  # an implementation's own random init (kaiming A) is the same for the same seed
    adapted = list(impl.inject(block, spec))
    adapters = impl.adapter_parameters(block)
    with torch.no_grad():
        for _name, p in adapters.items() if randomise else ():
            fan = p.shape[1]
            p.copy_((torch.randn(p.shape, device=device, generator=gen) * fan**-0.5).to(p.dtype))
    return Probe(impl, spec, shape, block, weights, adapters, adapted, spec_scale(spec), dtype, biases)


def effective_weight(probe: Probe, path: str) -> torch.Tensor:
    """The base weight (out, in) a quantised layer multiplies with, read through the layer itself: its output for
    the identity matrix with its lora_B zeroed (each output element is one weight times 1, exact in any dtype).
    A 4-bit base is the implementation's storage, not a weight this suite chose: the probe then judges the LoRA
    layer over that base (the quantiser itself is judged against bitsandbytes elsewhere)."""
    b = probe.adapters.get(f"{path}.lora_B")
    eye = torch.eye(probe.weights[path].shape[1], device=probe.weights[path].device, dtype=probe.dtype)
    with torch.no_grad():
        if b is None:
            out = _call_alone(probe.block, path, eye)
        else:
            saved = b.detach().clone()
            b.zero_()
            out = _call_alone(probe.block, path, eye)
            b.copy_(saved)
    return out.T.contiguous()


def _call_alone(block: nn.Module, path: str, x: torch.Tensor) -> torch.Tensor:
    """One projection's output for ``x``; q, k and v through the attention's own call (fused groups compute all
    three from one input)."""
    leaf = path.rsplit(".", 1)[-1]
    if leaf in ("q_proj", "k_proj", "v_proj"):
        return block.get_submodule("self_attn")(x)[("q_proj", "k_proj", "v_proj").index(leaf)]
    if leaf in MLP and hasattr(block.mlp, leaf):
        return getattr(block.mlp, leaf)(x)
    return block.get_submodule(path)(x)


@dataclass
class ProbeInputs:
    x: torch.Tensor  # (*N, K)
    x_o: torch.Tensor  # (*N, q_out)
    x_m: torch.Tensor  # (*N, K)
    dys: tuple[torch.Tensor, ...]  # one per output, OUTPUTS order


def random_inputs(
    shape: BlockShape, n_shape: tuple[int, ...], dtype, device, *, layout: str = "2d", seed: int = 1
) -> ProbeInputs:
    """Unit-variance inputs: 2-D (N, K), 3-D (B, N/B, K) or non-contiguous (every other column of a twice-as-wide
    tensor, stride 2 in the last dimension); upstream gradients of the outputs' shapes."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(width):
        lead = n_shape
        if layout == "3d":
            n = int(math.prod(n_shape))
            lead = (2, n // 2) if n % 2 == 0 else (1, n)
        if layout == "noncontig":
            return torch.randn(*lead, 2 * width, device=device, generator=gen).to(dtype)[..., ::2]
        return torch.randn(*lead, width, device=device, generator=gen).to(dtype)

    x, x_o, x_m = randn(shape.hidden), randn(shape.q_out), randn(shape.hidden)
    lead = x.shape[:-1]
    widths = (shape.q_out, shape.kv_out, shape.kv_out, shape.hidden, shape.hidden)
    dys = tuple(torch.randn(*lead, w, device=device, generator=gen).to(dtype) for w in widths)
    return ProbeInputs(x, x_o, x_m, dys)


@dataclass
class ProbeRun:
    """What one forward and backward gave: outputs (OUTPUTS order), input gradients (INPUTS order; None where
    the input took none) and every adapter's gradient (canonical name; None where it got none)."""

    outputs: tuple[torch.Tensor, ...]
    input_grads: tuple[torch.Tensor | None, ...]
    adapter_grads: dict[str, torch.Tensor | None]

    def tensors(self) -> dict[str, torch.Tensor | None]:
        out: dict[str, torch.Tensor | None] = dict(zip(OUTPUTS, self.outputs))
        out.update({f"d{n}": g for n, g in zip(INPUTS, self.input_grads)})
        out.update({f"d[{n}]": g for n, g in self.adapter_grads.items()})
        return out


def run_probe(probe: Probe, inputs: ProbeInputs, *, inputs_require_grad: bool = True, backward: bool = True):
    """Forward the three inputs through the block and backward every output's upstream gradient at once."""
    xs = [t.detach().requires_grad_(inputs_require_grad) for t in (inputs.x, inputs.x_o, inputs.x_m)]
    for p in probe.adapters.values():
        p.grad = None
    outs = probe.block(*xs)
    if backward:
        torch.autograd.backward(outs, inputs.dys)
    grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in probe.adapters.items()}
    return ProbeRun(
        tuple(o.detach() for o in outs),
        tuple(x.grad if inputs_require_grad and backward else None for x in xs),
        grads,
    )
