"""The layer-level criteria every implementation is judged by, on a probe block (``lora_suite.engine.probes``): each
function runs the probe and returns ``Verdict``s that a tier records as checks and a CPU self-test can assert on.

- parity (``parity_verdicts``): outputs, input gradients, dA and dB against float64, each kind counted apart,
  plus the dtypes F.linear and autograd give;
- determinism: the same input twice gives bitwise the same outputs and gradients;
- eval mode: with dropout 0, ``eval()`` computes the same function (within the parity tolerance);
- merged weights: where the implementation can merge (``merge_adapters``), the merged block gives the unmerged
  function;
- captured: where it declares capture, a CUDA graph's replay equals eager bitwise, with inputs and adapters changed
  after capture (replay must read the buffers afresh);
- gradient accumulation (two backward passes give twice the gradient, bitwise), adapter gradients when the input
  takes none, NaN confined to its row, a side stream, autocast's dtype.
"""

from __future__ import annotations

import math

import torch

from lora_suite.engine import probes as P
from lora_suite.judges import probe_judge as PJ
from lora_suite.judges.parity import compare
from lora_suite.measure.criteria import Verdict

KINDS = {  # tensor kind -> which of ProbeRun.tensors() names it holds
    "outputs": lambda n: n in P.OUTPUTS,
    "input gradients": lambda n: n.startswith("dx"),
    "dA": lambda n: n.endswith(".lora_A]"),
    "dB": lambda n: n.endswith(".lora_B]"),
}
PARITY_SOURCE = "tol = 8·(u_dtype + u_fp32·√k), x3 for the MLP chain; lora_suite/judges/parity.py"


def none_of(name: str, bad: list[str], source: str, sep: str = "; ", shown: int | None = 3) -> Verdict:
    """The verdict "no tensor, parameter or layer is in ``bad``": its count against 0, the first ``shown`` named
    (every one where None)."""
    return Verdict(name, len(bad), "==", 0, source, sep.join(bad[:shown]))


def parity_errors(probe: P.Probe, inputs: P.ProbeInputs, *, inputs_require_grad: bool = True):
    got = P.run_probe(probe, inputs, inputs_require_grad=inputs_require_grad)
    ref = PJ.reference(probe, inputs, inputs_require_grad=inputs_require_grad)
    return got, PJ.judge(probe, inputs, got, ref)


def parity_verdicts(label: str, cases: list[tuple[str, list, list[str]]]) -> list[Verdict]:
    """Verdicts over ``cases`` = [(case label, TensorErrors, dtype errors)]: per tensor kind, how many tensors are
    beyond tolerance (of how many), and how many have the wrong dtype."""
    out = []
    for kind, member in KINDS.items():
        errs = [(case, e) for case, es, _ in cases for e in es if member(e.name)]
        bad = [f"{case}: {e.describe()}" for case, e in errs if not e.ok]
        out.append(none_of(f"{label}: {kind} beyond tolerance (of {len(errs)})", bad, PARITY_SOURCE, shown=4))
    wrong = [f"{case}: {d}" for case, _, ds in cases for d in ds]
    out.append(none_of(f"{label}: outputs and gradients of the wrong dtype", wrong, "F.linear and autograd", shown=4))
    return out


def _differing(a: P.ProbeRun, b: P.ProbeRun) -> list[str]:
    ta, tb = a.tensors(), b.tensors()
    diff = []
    for name, u in ta.items():
        v = tb.get(name)
        if not (u is v if u is None or v is None else torch.equal(u, v)):  # both None, or bitwise equal
            worst = "" if u is None or v is None else f" (max diff {(u.double() - v.double()).abs().max():.3e})"
            diff.append(name + worst)
    return diff


def determinism(probe: P.Probe, inputs: P.ProbeInputs) -> Verdict:
    first, second = P.run_probe(probe, inputs), P.run_probe(probe, inputs)
    diff = _differing(first, second)
    return none_of(
        f"same input twice: tensors not bitwise equal (of {len(first.tensors())})",
        diff,
        "an implementation must be deterministic for a fixed input",
        shown=4,
    )


def _outputs_beyond(probe, inputs, got: P.ProbeRun) -> list[str]:
    ref = PJ.reference(probe, inputs)
    tols = PJ.tolerances(probe, inputs)
    errs = [compare(n, g, r, tols[n]) for n, g, r in zip(P.OUTPUTS, got.outputs, ref.outputs)]
    return [e.describe() for e in errs if not e.ok]


def eval_mode(probe: P.Probe, inputs: P.ProbeInputs) -> Verdict:
    """``eval()`` under the same (dropout-free) function: outputs against float64."""
    probe.block.eval()
    try:
        with torch.no_grad():
            got = P.run_probe(probe, inputs, inputs_require_grad=False, backward=False)
    finally:
        probe.block.train()
    bad = _outputs_beyond(probe, inputs, got)
    return none_of(f"eval mode: outputs beyond tolerance (of {len(P.OUTPUTS)})", bad, PARITY_SOURCE)


def merged(probe: P.Probe, inputs: P.ProbeInputs) -> Verdict:
    """The implementation's merge (the probe's block is merged in place: use it last) against the unmerged function."""
    probe.impl.merge_adapters(probe.block)
    with torch.no_grad():
        got = P.run_probe(probe, inputs, inputs_require_grad=False, backward=False)
    bad = _outputs_beyond(probe, inputs, got)
    return none_of(
        f"merged weights: outputs beyond tolerance (of {len(P.OUTPUTS)})",
        bad,
        PARITY_SOURCE + " (one more rounding of W: inside it)",
    )


def no_input_gradient(probe: P.Probe, inputs: P.ProbeInputs) -> Verdict:
    got, errs = parity_errors(probe, inputs, inputs_require_grad=False)
    bad = [e.describe() for e in errs if not e.ok]
    extra = [n for n, g in zip(P.INPUTS, got.input_grads) if g is not None]
    return none_of(
        f"inputs without grad: adapter gradients beyond tolerance or input gradients made (of {len(errs)})",
        bad + extra,
        PARITY_SOURCE,
    )


def accumulation(probe: P.Probe, inputs: P.ProbeInputs) -> Verdict:
    """Two backward passes without zeroing: every adapter gradient is twice one pass's, bitwise."""
    once = P.run_probe(probe, inputs).adapter_grads
    xs = [t.detach().requires_grad_() for t in (inputs.x, inputs.x_o, inputs.x_m)]
    for p in probe.adapters.values():
        p.grad = None
    for _ in range(2):
        torch.autograd.backward(probe.block(*xs), inputs.dys)
    bad = [
        n
        for n, p in probe.adapters.items()
        if once[n] is None or p.grad is None or not torch.equal(p.grad, 2 * once[n])
    ]
    return none_of(
        f"two backward passes: adapter gradients not twice one pass's (of {len(once)})",
        bad,
        "autograd accumulates into .grad",
        sep=", ",
        shown=4,
    )


def nan_rows(probe: P.Probe, inputs: P.ProbeInputs) -> Verdict:
    """A NaN in one token's input gives NaN in that token's outputs only (as F.linear does)."""
    x = inputs.x.detach().clone().reshape(-1, inputs.x.shape[-1])
    if x.shape[0] < 2:
        raise ValueError("nan_rows needs at least two tokens")
    x[0, 1] = math.nan
    poisoned = P.ProbeInputs(x.reshape(inputs.x.shape), inputs.x_o, inputs.x_m, inputs.dys)
    with torch.no_grad():
        outs = P.run_probe(probe, poisoned, inputs_require_grad=False, backward=False).outputs[:3]
    bad = []
    for name, o in zip(("q", "k", "v"), outs):
        rows = o.reshape(-1, o.shape[-1])
        if not torch.isnan(rows[0]).any():
            bad.append(f"{name}: the poisoned token's output holds no NaN")
        if not torch.isfinite(rows[1:]).all():
            bad.append(f"{name}: {int((~torch.isfinite(rows[1:])).any(dim=1).sum())} other tokens' outputs not finite")
    return none_of(
        "NaN in one token: outputs contaminated or not propagated (q, k, v)",
        bad,
        "F.linear: rows are independent",
        shown=None,
    )


def side_stream(probe: P.Probe, inputs: P.ProbeInputs) -> Verdict:
    """The probe on a side stream whose input a slow matmul on that stream produces: bitwise the default stream's."""
    expected = P.run_probe(probe, inputs)
    side = torch.cuda.Stream()
    big = torch.randn(8192, 8192, device=inputs.x.device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        slow = big @ big  # keeps the side stream busy before x exists
        x = inputs.x + (slow[0, 0] * 0).to(inputs.x.dtype)
        got = P.run_probe(probe, P.ProbeInputs(x, inputs.x_o, inputs.x_m, inputs.dys))
    torch.cuda.synchronize()
    diff = _differing(expected, got)
    return none_of(
        "on a side stream: tensors not bitwise equal to the default stream's",
        diff,
        "work must follow torch's current stream",
        shown=4,
    )


def autocast_dtype(probe: P.Probe, inputs: P.ProbeInputs, dtype=torch.bfloat16) -> Verdict:
    """fp32 inputs under ``torch.autocast(dtype)``: every output in ``dtype`` (as F.linear's)."""
    fp32 = P.ProbeInputs(inputs.x.float(), inputs.x_o.float(), inputs.x_m.float(), tuple(d.float() for d in inputs.dys))
    with torch.autocast(inputs.x.device.type, dtype=dtype), torch.no_grad():
        outs = P.run_probe(probe, fp32, inputs_require_grad=False, backward=False).outputs
    bad = [f"{n}: {o.dtype}" for n, o in zip(P.OUTPUTS, outs) if o.dtype != dtype]
    return none_of(
        f"under autocast({dtype}): outputs of another dtype", bad, "F.linear under autocast", sep=", ", shown=None
    )


def _grad(t: torch.Tensor) -> torch.Tensor:
    """``t``'s gradient, which ``captured`` set (zeros) before the capture and the captured backward writes."""
    assert t.grad is not None, f"a tensor of shape {tuple(t.shape)} without the gradient set before capture"
    return t.grad


def captured(probe: P.Probe, inputs: P.ProbeInputs, fresh: P.ProbeInputs) -> Verdict:
    """Forward and backward captured in a CUDA graph, replayed with ``fresh`` inputs and changed adapters, against
    eager on the same values, bitwise."""
    xs = [t.detach().clone().requires_grad_() for t in (inputs.x, inputs.x_o, inputs.x_m)]
    dys = [d.clone() for d in inputs.dys]

    def step():
        for t in xs:
            t.grad = None
        for p in probe.adapters.values():
            p.grad = None
        outs = probe.block(*xs)
        torch.autograd.backward(outs, dys)
        return outs

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside capture, as torch's docs require
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in xs:
        t.grad = torch.zeros_like(t)
    for p in probe.adapters.values():
        p.grad = torch.zeros_like(p)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = probe.block(*xs)
        torch.autograd.backward(outs, dys)
    with torch.no_grad():
        for t, new in zip(xs, (fresh.x, fresh.x_o, fresh.x_m)):
            t.copy_(new)
        for d, new in zip(dys, fresh.dys):
            d.copy_(new)
        for p in probe.adapters.values():
            p.add_(0.01 * torch.randn_like(p))
    for g in [_grad(t) for t in xs] + [_grad(p) for p in probe.adapters.values()]:
        g.zero_()
    graph.replay()
    replayed = P.ProbeRun(
        tuple(o.detach().clone() for o in outs),
        tuple(_grad(t).clone() for t in xs),
        {n: _grad(p).clone() for n, p in probe.adapters.items()},
    )
    eager = P.run_probe(probe, fresh)
    diff = _differing(replayed, eager)
    return none_of(
        "captured replay: tensors not bitwise equal to eager",
        diff,
        "replay runs the recorded kernels on the same data",
        shown=4,
    )
