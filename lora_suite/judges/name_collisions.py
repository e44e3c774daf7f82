"""Module names that collide with the words of an adapter's state-dict keys, and the adapters must still be found,
trained, saved and loaded as their own.

A stack finds its adapters, its base weights and its folder's tensors by name: PEFT's keys are
``base_model.model.<path>.lora_A.weight``, and a stack that strips ``.weight``, looks for ``lora_`` or the adapter's
name (``default``) anywhere in a key, or matches a target as a prefix, confuses a module named like one of those
words with its own tensors (peft#2773: layer names holding "weight" or the adapter's name were not loaded; loralib's
``mark_only_lora_as_trainable`` marks every parameter whose name holds ``lora_``). The probe here is a block of
square linears named ``NAMES`` (the words of the keys, one name a prefix of another), all targeted:

    y(x) = Σₙ x Wₙᵀ + s·(x Aₙᵀ) Bₙᵀ     n over NAMES

judged (``name_collisions``) for the adapters listed (each named module exactly once, nothing else), the base frozen,
the float64 function within fp32's tolerance, and the round trip: saved, loaded into a fresh block, the adapters and
the output bitwise the trained ones. A stack whose ``inject`` refuses such names says so: its refusal (the stack's
own words) is the verdict's detail and the cell is not applicable.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from lora_suite.implementations import AdapterSpec, LoRAImplementation
from lora_suite.judges.layer_checks import none_of
from lora_suite.judges.parity import compare, tolerance
from lora_suite.measure.criteria import Verdict

# The words of a PEFT key, PEFT's adapter name and wrapper attribute, and names one of which is a prefix of another
NAMES = ("weight", "bias", "default", "base_layer", "lora_x", "q", "q_proj")
WIDTH, R, ALPHA = 24, 4, 7.3  # square (the merge-free function needs no orientation); s = 7.3/4 inexact in bf16
SOURCE = "keys are <path>.lora_A.weight whatever the path holds; peft#2773; loralib's mark_only_lora_as_trainable"


class Colliding(nn.Module):
    """``block.<name>`` for each of ``NAMES``: a bias-free square linear; the output is their sum."""

    def __init__(self, device, dtype=torch.float32):
        super().__init__()
        self.block = nn.Module()
        for n in NAMES:
            self.block.add_module(n, nn.Linear(WIDTH, WIDTH, bias=False, device=device, dtype=dtype))

    def forward(self, x):
        return sum(getattr(self.block, n)(x) for n in NAMES)


def build(impl: LoRAImplementation, device, seed: int = 0) -> tuple[Colliding, dict[str, torch.Tensor]]:
    """A fresh block of seeded weights (std 1/√in), adapted by ``impl`` on every name; its base weights before."""
    torch.manual_seed(seed)
    model = Colliding(device)
    linears = {n: model.block.get_submodule(n) for n in NAMES}
    with torch.no_grad():
        for m in linears.values():
            assert isinstance(m, nn.Linear), "Colliding holds linears"
            m.weight.normal_(0, WIDTH**-0.5)
    weights = {n: m.weight.detach().clone() for n, m in linears.items() if isinstance(m, nn.Linear)}
    impl.inject(model, AdapterSpec(NAMES, R, ALPHA, False, torch.float32))
    return model, weights


def _expected() -> set[str]:
    return {f"block.{n}.lora_{w}" for n in NAMES for w in "AB"}


def _reference(x, weights, adapters) -> torch.Tensor:
    """The float64 function: Σₙ x Wₙᵀ + s·(x Aₙᵀ) Bₙᵀ."""
    s, xd = ALPHA / R, x.double()
    y = torch.zeros(x.shape[0], WIDTH, dtype=torch.float64, device=x.device)
    for n in NAMES:
        a, b = adapters[f"block.{n}.lora_A"].double(), adapters[f"block.{n}.lora_B"].double()
        y = y + xd @ weights[n].double().T + s * (xd @ a.T) @ b.T
    return y


LABEL = f"modules named like the words of adapter keys ({', '.join(NAMES)})"


def name_collisions(impl: LoRAImplementation, device) -> tuple[list[Verdict], str | None]:
    """The three verdicts of the module docstring; or none and ``inject``'s refusal of these names (the stack's own
    words), for the caller to record as not applicable."""
    label = LABEL
    try:
        model, weights = build(impl, device)
    except ValueError as exc:  # ImplementationError is one: a refusal, loud, in the stack's own words
        return [], f"{impl.name}'s inject refuses these names: {exc}"
    adapters = impl.adapter_parameters(model)
    listed = set(adapters)
    missing, extra = sorted(_expected() - listed), sorted(listed - _expected())
    mine = {id(p) for p in adapters.values()}
    trainable = [n for n, p in model.named_parameters() if id(p) not in mine and p.requires_grad]
    found = none_of(
        f"{label}: adapters missing or extra, or base parameters trainable (of {len(_expected())})",
        [f"{n} missing" for n in missing] + [f"{n} listed" for n in extra] + [f"{n} trainable" for n in trainable],
        SOURCE,
    )
    if missing:
        return [found], None
    gen = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for p in adapters.values():
            p.copy_(torch.randn(p.shape, device=device, generator=gen) * p.shape[1] ** -0.5)
    x = torch.randn(5, WIDTH, device=device, generator=gen)
    y = model(x).detach()
    err = compare("y", y, _reference(x, weights, adapters), tolerance(torch.float32, WIDTH))
    function = none_of(
        f"{label}: outputs off the float64 function (of {y.shape[0]} tokens)",
        [] if err.ok else [err.describe()],
        SOURCE,
    )
    return [found, function, _round_trip(impl, model, x, y, device, label)], None


def _round_trip(impl, model, x, y, device, label) -> Verdict:
    """Saved, loaded into a fresh block: every adapter bitwise the trained one, the output bitwise."""
    folder = Path(tempfile.mkdtemp(prefix="lora-names-"))
    n = len(NAMES) * 2 + 1
    try:
        impl.save_adapter(model, folder / "adapter")
        fresh, _ = build(impl, device)
        impl.load_adapter(fresh, folder / "adapter")
        trained, loaded = impl.adapter_parameters(model), impl.adapter_parameters(fresh)
        bad = [k for k, p in trained.items() if k not in loaded or not torch.equal(loaded[k].detach(), p.detach())]
        if not torch.equal(fresh(x).detach(), y):
            bad.append("output")
        why = "; ".join(bad[:3])
        value = float(len(bad))
    except Exception as exc:  # noqa: BLE001  (a save or load that breaks on these names is the verdict, named)
        why, value = f"{type(exc).__name__}: {str(exc)[:300]}", math.inf
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return Verdict(
        f"{label}: saved and loaded into a fresh model, adapters or outputs not bitwise the trained ones (of {n})",
        value,
        "==",
        0,
        SOURCE,
        why,
    )
