"""The adapted probe block as a sequence of lifecycle rules leaves it, and what it must then compute
(``lora_suite.judges.lifecycle`` draws the sequences).

The state is the probe (``lora_suite.engine.probes``), the base weights W₀ the reference uses (in the block's
current dtype), the mode (train or eval), the adapters folded by a merge (None while unmerged), the adapters of the
last save, and a snapshot of every non-adapter parameter. After every rule (``check``):

    y(x) = x W₀ᵀ + b + s·(x Âᵀ) B̂ᵀ   for each projection, in float64 (``probe_judge.reference``; b where there are biases)

with Â, B̂ the adapters as ``adapter_parameters`` reads them *now* (after a merge: the ones it folded; after a
load: the saved ones), rounded to the activation dtype; every output within ``probe_judge.tolerances`` of it in a
train-mode forward with grad enabled and in an eval-mode forward under ``torch.no_grad``; every non-adapter parameter
bitwise its snapshot (taken at build, after a merge, cast by a dtype change), frozen and without a gradient. Rules
with a backward also judge the adapter and input gradients against float64's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from lora_suite.engine import probes as P
from lora_suite.implementations import AdapterSpec, LoRAImplementation
from lora_suite.judges import probe_judge as PJ
from lora_suite.judges.hypothesis_profiles import below_range, outside_the_contract

# The dtype change rule casts the whole block to the partner of its current dtype and back: fp32 -> bf16 rounds
# every tensor once (RNE), bf16 -> fp32 is exact.
PARTNER = {torch.float32: torch.bfloat16, torch.bfloat16: torch.float32}
CHECK_SEED = 424242  # the inputs every after-rule check uses (a rule's own come from ``next_seed``)
# Learning rates of the training step (loss Σ⟨y, dy⟩ / n over n tokens, dy unit-variance). AdamW moves every element
# by about lr per step (its first step is lr·sign(g)); SGD's gradient is first clipped, tensor by tensor, to the
# norm of the adapter it updates, so a step moves each adapter by at most lr of its own size. Against adapter elements
# of 1/√in (A: 0.03 to 0.15 on the probe widths) and 1/√r (B) that is a change of several to ten percent, beyond
# bf16's tolerance (3%), so a stale value shows; and growth by at most (1 + lr) per step, far from overflow in the
# 25 rules of the nightly profile's longest sequence (unclipped SGD on the MLP's product of adapters diverged there).
LR = {"sgd": 0.1, "adamw": 2e-2}


def _in_range(what: str, ref: P.ProbeRun, dtype: torch.dtype) -> None:
    """A sequence whose float64 outputs leave fp16's range (training on the unbounded loss Σ⟨y, dy⟩ grows them; fp16
    overflows at 65504) is outside the contract, as a layer property's case is (``hypothesis_profiles``)."""
    if dtype == torch.float16 and not below_range((float(o.abs().max()) for o in ref.outputs), dtype):
        outside_the_contract(f"{what}: the float64 outputs leave {dtype}'s range")


class LifecycleBroken(AssertionError):
    """A rule (or the check after it) found the model off the function of its current adapters."""


@dataclass(frozen=True)
class Build:
    """How every probe of one lifecycle is built (the first one, and each fresh one a load goes into)."""

    impl: LoRAImplementation
    shape: P.BlockShape
    spec: AdapterSpec
    dtype: torch.dtype
    device: str
    seed: int = 0
    tokens: tuple[int, ...] = (2, 5)

    def probe(self) -> P.Probe:
        return P.build_probe(self.impl, self.shape, self.spec, self.dtype, self.device, seed=self.seed)

    def inputs(self, seed: int, dtype: torch.dtype) -> P.ProbeInputs:
        return P.random_inputs(self.shape, self.tokens, dtype, self.device, seed=seed)


def describe(bad: list[str], shown: int = 3) -> str:
    more = f" (and {len(bad) - shown} more)" if len(bad) > shown else ""
    return "; ".join(bad[:shown]) + more


def _changed(now: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor]) -> list[str]:
    """The parameters of ``now`` not bitwise their snapshot in ``frozen`` (dtype, shape and every element; a NaN is
    never equal), read in one transfer."""
    common = [n for n in now if n in frozen]
    bad = [n for n in common if now[n].dtype != frozen[n].dtype or now[n].shape != frozen[n].shape]
    same = [n for n in common if n not in bad]
    if same:
        equal = torch.stack([(now[n].detach() == frozen[n]).all() for n in same]).tolist()
        bad += [n for n, ok in zip(same, equal) if not ok]
    return bad


class Lifecycle:
    """The probe under the rules. Each rule method raises ``LifecycleBroken`` naming what broke."""

    def __init__(self, build: Build, folder: Path):
        self.build, self.folder = build, folder
        self.saved: dict[str, torch.Tensor] | None = None
        self.saves = self.seeds = 0
        self._adopt(build.probe())

    def _adopt(self, probe: P.Probe) -> None:
        self.probe, self.dtype, self.training = probe, probe.dtype, True
        self.weights = dict(probe.weights)  # W₀ per module path, in the block's current dtype
        self.biases = dict(probe.biases)  # the base biases likewise (empty when the shape has none)
        self.merged: dict[str, torch.Tensor] | None = None
        self.unmerged = False  # an unmerge ran on this probe: its base is W₀ within one merge's rounding, no closer
        # per adapter, the factor of the last set_adapter_scale (it sets every adapter the model holds; one added later
        # starts at its spec's scale): the active adapter's scale is probe.scale times its factor
        self.factors = {"default": 1.0}
        # per adapter, its own scale before any factor: the spec's, or 1 for one a combination made (its sources'
        # scales are folded into its B)
        self.scales = {"default": probe.scale}
        self.present, self.active = ["default"], "default"  # the adapters the model holds by name, the active one
        self.names = sorted(probe.adapters)
        self.optimizer: torch.optim.Optimizer | None = None
        self._opt_key: tuple[str, tuple[tuple[int, torch.dtype], ...]] | None = None
        probe.block.train()
        self.frozen = self.snapshot()

    def next_seed(self) -> int:
        """The seed of the next rule's inputs or values: 1, 2, ... in the order the rules run (so that a printed
        sequence replays the same tensors)."""
        self.seeds += 1
        return self.seeds

    # what the model holds now
    def live(self) -> dict[str, torch.nn.Parameter]:
        return self.build.impl.adapter_parameters(self.probe.block)

    def _base_now(self) -> dict[str, torch.Tensor]:
        ids = {id(p) for p in self.live().values()}
        return {n: p for n, p in self.probe.block.named_parameters() if id(p) not in ids}

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self._base_now().items()}

    def reference_probe(self) -> P.Probe:
        if self.merged is None:
            adapters = self.live()
        else:  # a Probe holds parameters: the folded copies as frozen ones (their storage, not a copy)
            adapters = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in self.merged.items()}
        return dataclasses.replace(
            self.probe,
            weights=self.weights,
            biases=self.biases,
            adapters=adapters,
            dtype=self.dtype,
            scale=self.scales[self.active] * self.factors[self.active],
        )

    def run_probe(self) -> P.Probe:
        return dataclasses.replace(self.probe, adapters={} if self.merged is not None else self.live())

    # judging
    def judge(
        self, what: str, inputs: P.ProbeInputs, got: P.ProbeRun, ref: P.ProbeRun, probe: P.Probe | None = None
    ) -> None:
        """Every tensor ``ref`` holds within its tolerance, every output in the activation dtype (``probe``: the
        reference's, the current adapters' by default)."""
        probe = probe or self.reference_probe()
        _in_range(what, ref, self.dtype)
        bad = [e.describe() for e in PJ.judge(probe, inputs, got, ref) if not e.ok]
        bad += [
            f"{n}: {o.dtype} (expected {self.dtype})" for n, o in zip(P.OUTPUTS, got.outputs) if o.dtype != self.dtype
        ]
        if bad:
            raise LifecycleBroken(f"{what}: beyond the float64 function of the current adapters: {describe(bad)}")

    def forward(self, seed: int, *, grad: bool, what: str, ref: P.ProbeRun | None = None) -> P.ProbeRun:
        """One forward in the current mode (grad enabled or not, no backward), outputs judged against ``ref`` (the
        float64 run of these inputs; computed when not given). Returns the reference, for another forward of the same
        inputs and adapters."""
        inputs = self.build.inputs(seed, self.dtype)
        with torch.set_grad_enabled(grad):
            got = P.run_probe(self.run_probe(), inputs, inputs_require_grad=False, backward=False)
        if ref is None:
            ref = PJ.reference(self.reference_probe(), inputs, inputs_require_grad=False, backward=False)
        self.judge(what, inputs, got, ref)
        return ref

    def base_changes(self, now: dict[str, torch.Tensor] | None = None) -> list[str]:
        """The parameters of the snapshot (base weights, inactive adapters) gone or not bitwise as they were."""
        now = self._base_now() if now is None else now
        return [f"{n} gone" for n in self.frozen if n not in now] + [f"{n} changed" for n in _changed(now, self.frozen)]

    def check(self) -> None:
        """After every rule: the base untouched and frozen, the adapters listed and trainable, and the function of
        the current adapters in a train-mode forward with grad and an eval-mode forward without."""
        now = self._base_now()
        bad = self.base_changes(now)
        bad += [f"{n} appeared" for n in now if n not in self.frozen]
        bad += [f"{n} trainable or holding a gradient" for n, p in now.items() if p.requires_grad or p.grad is not None]
        if self.merged is None:
            live = self.live()
            if sorted(live) != self.names:
                bad.append(f"adapter_parameters lists {len(live)} adapters, {len(self.names)} after inject")
            bad += [f"{n} not trainable" for n, p in live.items() if not p.requires_grad]
        if bad:
            raise LifecycleBroken(f"base parameters or adapters: {describe(bad)}")
        mode = self.training
        try:
            self.probe.block.train()
            ref = self.forward(CHECK_SEED, grad=True, what="train-mode forward")
            self.probe.block.eval()  # the same inputs and adapters: the same float64 reference
            self.forward(CHECK_SEED, grad=False, what="eval-mode forward under no_grad", ref=ref)
        finally:
            self.probe.block.train(mode)

    # rules
    def set_mode(self, training: bool) -> None:
        self.training = training
        self.probe.block.train(training)

    def _opt(self, kind: str) -> torch.optim.Optimizer:
        """The rule's optimizer over the live adapters. AdamW over fp16 adapters takes eps = 1e-4 (fp16's usual one):
        its default 1e-8 rounds to 0 in fp16 and its second moment g² underflows there (below 6e-8), so it divides 0
        by 0 (an H100 run of loralib, fp16 adapters: NaN after one step): the optimizer's fp16 arithmetic, not the
        stack's."""
        live = self.live()
        key = (kind, tuple((id(p), p.dtype) for p in live.values()))
        if key != self._opt_key:
            params = list(live.values())
            if kind == "sgd":
                self.optimizer = torch.optim.SGD(params, lr=LR[kind])
            else:
                fp16 = any(p.dtype == torch.float16 for p in params)
                self.optimizer = torch.optim.AdamW(params, lr=LR[kind], eps=1e-4 if fp16 else 1e-8)
            self._opt_key = key
        assert self.optimizer is not None, "an optimizer is built with the key it matches"
        return self.optimizer

    def train_step(self, optimizer: str, seed: int) -> None:
        """Forward and backward of a random loss Σ⟨y, dy⟩ / n (gradients judged), then one optimizer step."""
        inputs = self.build.inputs(seed, self.dtype)
        n = inputs.x.numel() // inputs.x.shape[-1]
        inputs = dataclasses.replace(inputs, dys=tuple(d / n for d in inputs.dys))
        got = P.run_probe(self.run_probe(), inputs)
        self.judge("training step's backward", inputs, got, PJ.reference(self.reference_probe(), inputs))
        opt = self._opt(optimizer)
        if optimizer == "sgd":
            for p in self.live().values():
                if p.grad is not None:
                    torch.nn.utils.clip_grad_norm_([p], max_norm=float(p.detach().float().norm()))
        opt.step()
        opt.zero_grad(set_to_none=True)

    def two_forwards(self, seed: int) -> None:
        """Two forwards, then one backward of both: adapter gradients the sum of each forward's."""
        first, second = self.build.inputs(seed, self.dtype), self.build.inputs(seed + 1, self.dtype)
        live = self.live()
        for p in live.values():
            p.grad = None
        outs = [self.probe.block(i.x, i.x_o, i.x_m) for i in (first, second)]
        torch.autograd.backward([*outs[0], *outs[1]], [*first.dys, *second.dys])
        grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in live.items()}
        for p in live.values():
            p.grad = None
        refs = [PJ.reference(self.reference_probe(), i, inputs_require_grad=False) for i in (first, second)]
        summed: dict[str, torch.Tensor | None] = {}
        for n, first_grad in refs[0].adapter_grads.items():
            second_grad = refs[1].adapter_grads[n]
            assert first_grad is not None and second_grad is not None, f"{n}: float64 gives every adapter a gradient"
            summed[n] = first_grad + second_grad
        got = P.ProbeRun(tuple(o.detach() for o in outs[0]), (None,) * 3, grads)
        self.judge("two forwards, one backward", first, got, P.ProbeRun(refs[0].outputs, (None,) * 3, summed))

    def checkpointed(self, seed: int) -> None:
        """A non-reentrant ``torch.utils.checkpoint`` forward and its backward (the forward recomputed)."""
        inputs = self.build.inputs(seed, self.dtype)
        xs = [t.detach().requires_grad_() for t in (inputs.x, inputs.x_o, inputs.x_m)]
        live = self.live() if self.merged is None else {}
        for p in live.values():
            p.grad = None
        outs = checkpoint(self.probe.block, *xs, use_reentrant=False)
        torch.autograd.backward(outs, list(inputs.dys))
        grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in live.items()}
        for p in live.values():
            p.grad = None
        got = P.ProbeRun(tuple(o.detach() for o in outs), tuple(x.grad for x in xs), grads)
        ref = PJ.reference(self.reference_probe(), inputs)
        if self.merged is not None:  # the folded adapters are no parameters: no gradient is due to them
            ref = P.ProbeRun(ref.outputs, ref.input_grads, {})
        self.judge("non-reentrant checkpointed forward and backward", inputs, got, ref)

    def rewrite(self, seed: int) -> None:
        """New random values written into the adapters in place (what a user's init or load_state_dict does)."""
        gen = torch.Generator(device=self.build.device).manual_seed(seed)
        with torch.no_grad():
            for p in self.live().values():
                p.copy_(torch.randn(p.shape, device=p.device, generator=gen) * p.shape[1] ** -0.5)

    def merge(self) -> None:
        """``merge_adapters``: the model must then compute the function of the adapters it folded."""
        folded = {n: p.detach().clone() for n, p in self.live().items()}
        self.build.impl.merge_adapters(self.probe.block)
        self.merged = folded
        self.frozen = self.snapshot()  # the merged weights: untouched from now on

    def save(self) -> None:
        self.saves += 1
        self.saved = {n: p.detach().clone() for n, p in self.live().items()}
        self.build.impl.save_adapter(self.probe.block, self.folder / f"save{self.saves}")

    def _loaded(self, what: str) -> None:
        self.build.impl.load_adapter(self.probe.block, self.folder / f"save{self.saves}")
        assert self.saved is not None, f"{what}: a load follows a save"
        live = self.live()
        bad = [n for n, t in self.saved.items() if n not in live or not torch.equal(live[n].detach(), t.to(live[n]))]
        if bad:
            raise LifecycleBroken(f"{what}: adapters not the saved ones: {describe(bad)}")

    def load_fresh(self) -> None:
        """A fresh probe built the same way (same seed), its adapters rewritten (so that a load that changes nothing
        cannot pass for one that loaded the saved values), run once in each mode, then ``load_adapter``."""
        self._adopt(self.build.probe())
        self.rewrite(self.next_seed())
        self.check()  # the fresh model's own function first, as a user's look at it before loading
        self._loaded("load into a fresh model")

    def load_here(self) -> None:
        """``load_adapter`` into the model itself (a resumed run): it must compute the saved function."""
        self._loaded("load into the same model")

    def to_partner_dtype(self) -> None:
        """The whole block cast to the partner dtype: base weights, adapters, the snapshots with it. (Not after a
        merge: a merged weight rounded to bf16 is W₀ + ΔW rounded as a whole, no longer a function of the folded
        adapters that fp32's tolerance could judge; nor after an unmerge: the base is then W₀ + ΔW − ΔW as rounded in
        the dtype of the merge, within that dtype's tolerance of W₀ but not fp32's after a cast, and a near-tie
        rounds it to another bf16 value than W₀'s.)"""
        new = PARTNER[self.dtype]
        self.probe.block.to(new)
        self.dtype = new
        self.weights = {k: w.to(new) for k, w in self.weights.items()}
        self.biases = {k: b.to(new) for k, b in self.biases.items()}
        self.frozen = {k: w.to(new) for k, w in self.frozen.items()}
