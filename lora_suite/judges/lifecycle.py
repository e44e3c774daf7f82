"""The adapter's lifecycle as a Hypothesis state machine (``hypothesis.stateful``), for any implementation through the
contract only (``inject``, ``adapter_parameters``, ``save_adapter``, ``load_adapter``, ``merge_adapters`` where it
has one), on the probe block of ``lora_suite.engine.probes``.

Rules, drawn in random orders, each with the preconditions it needs:

- a training step: forward and backward of a random loss Σ⟨y, dy⟩, then one SGD or AdamW step on the adapters;
- a forward in the current mode (grad enabled or not); a switch to train() or eval();
- two forwards, then one backward of both (gradients: the sum of each forward's);
- a non-reentrant ``torch.utils.checkpoint`` forward and its backward;
- new values written into the adapters in place (a user's init, ``load_state_dict``);
- ``merge_adapters`` (where implemented; the rules that need adapters are then off), and again on a merged model
  (nothing folded twice); ``unmerge_adapters`` (where implemented: the adapters back, the base W₀ within rounding);
- a forward inside ``disabled_adapters`` (the base function; with an exception raised inside the block too, after
  which the adapters must apply again); ``set_adapter_scale`` to a factor (0.5, 1, 1/3, 2.7: the scale then that
  factor times the spec's, never compounded); a second adapter added (its name reused after a delete), switched to
  and deleted (where the stack holds several: the active one's function, the others frozen and untouched); two
  adapters combined by weight into a third (where the stack combines: its update Σ wᵢ·sᵢ·Bᵢ·Aᵢ with the scales of
  the moment, the name reused, the sources untouched), which the other rules may then switch to, train and delete;
- ``save_adapter`` (once at the start of every sequence, and as a rule); ``load_adapter`` of the last save into a
  fresh probe built the same way (same seed), after that fresh model has run once in each mode, or into the model
  itself;
- the whole block cast to another floating dtype (fp32 <-> bf16; not on a 4-bit base, not after a merge or an
  unmerge).

After every rule (``lifecycle_state.Lifecycle.check``) the model computes the float64 function of its *current*
adapters, y = x W₀ᵀ + s·(x Âᵀ) B̂ᵀ within the parity tolerance, in train mode with grad and in eval mode without
(eval = the current weights, merged = the unmerged function, loaded = the saved one), and every base parameter is
bitwise its snapshot, frozen, without a gradient. So a value computed once and reused (s·B·A, an eval output, a
merged weight), or one that depends on what ran before, breaks it within a few rules. ``run_lifecycle`` runs the
machine and returns one ``Verdict``; a failure's detail is Hypothesis' shrunk program (the minimal sequence of
rules), which ``replay`` runs again.
"""

from __future__ import annotations

import ast
from collections import Counter
from typing import Any

import torch
from hypothesis import seed as hypothesis_seed
from hypothesis import settings
from hypothesis.stateful import get_state_machine_test

from lora_suite.engine import probes as P
from lora_suite.implementations import AdapterSpec, LoRAImplementation
from lora_suite.judges.hypothesis_profiles import suite_settings
from lora_suite.judges.lifecycle_rules import (  # noqa: F401 (re-exported: the tests' and replay's handles)
    ADAPTER_NAMES,
    FACTORS,
    NEEDS,
    _always,
    lifecycle_machine,
)
from lora_suite.judges.lifecycle_state import PARTNER, Build, Lifecycle, LifecycleBroken  # noqa: F401 (re-exported)
from lora_suite.measure.criteria import Verdict


def _settings(parts: int = 1) -> settings:
    """The suite's profile (``lora_suite.judges.hypothesis_profiles``: derandomised ``ci`` by default, ``nightly``
    by ``LORA_SUITE_HYPOTHESIS_PROFILE``) with twice its sequences, shared by ``parts`` runs, the lifecycle's one
    place to change it: ``ci`` then runs 24 sequences of up to 12 rules, each followed by its check (12 in each of two
    parts). Why twice: Hypothesis enables a random subset of the rules in each sequence (swarm testing), and 12
    sequences left a rule unreached under some derandomised seeds; the fixed tour (``tour``, in part 1) now reaches
    every rule a stack offers whatever is drawn (``tests/suite/judges/test_lifecycle.py`` asserts it). 24 cost ~5 s per
    dtype on the CPU's tiny probe, ~27 s on an H200 shared by the quick tier's workers, hence the parts (each its own
    test, run side by side)."""
    return suite_settings(scale=2.0 / parts)


PART_SEED = 55_000  # part k of a derandomised run draws from seed PART_SEED + k (one part alone: Hypothesis' own)


SOURCE = (
    "after every rule the float64 function of the current adapters (eval = current weights, merged = unmerged, "
    "loaded = saved), base bitwise frozen; PEFT's testing_common.py; tol: lora_suite/judges/parity.py"
)


def failure_detail(exc: BaseException) -> str:
    """What broke (the exception) and Hypothesis' shrunk program (its notes: ``state = AdapterLifecycle()``, then one
    ``state.<rule>(...)`` line per step, the check after each)."""
    notes = [n for n in getattr(exc, "__notes__", []) if n.strip()]
    program = "\n".join(notes) if notes else "(Hypothesis printed no program)"
    return (
        f"{type(exc).__name__}: {exc}\nshrunk sequence (rerun it with lora_suite.judges.lifecycle.replay):\n{program}"
    )


def run_lifecycle(
    impl: LoRAImplementation,
    shape: P.BlockShape,
    spec: AdapterSpec,
    dtype: torch.dtype,
    device,
    *,
    seed: int = 0,
    tokens: tuple[int, ...] = (2, 5),
    label: str | None = None,
    settings: settings | None = None,
    ran: Counter | None = None,
    part: tuple[int, int] = (0, 1),
) -> Verdict:
    """The machine of (impl, shape, spec, dtype, device, seed) run under ``settings`` (``_settings(parts)`` by
    default): how many rule sequences broke (0 or 1: Hypothesis stops at the first and shrinks it) of how many ran
    (those of the shrinking included); ``ran`` (where given) counts each rule's calls. ``part`` = (k, parts): the k-th
    of ``parts`` runs that share the sequences (a derandomised profile gives each part its own fixed seed, so the parts
    draw different sequences; a random one draws anew in each)."""
    k, parts = part
    if not 0 <= k < parts:
        raise ValueError(f"part={part!r}: expected (k, parts) with 0 <= k < parts")
    build = Build(impl, shape, spec, dtype, str(device), seed, tokens)
    runs: list = []
    chosen = settings or _settings(parts)
    test = get_state_machine_test(lifecycle_machine(build, runs, ran), settings=chosen)
    if parts > 1 and chosen.derandomize:
        test = hypothesis_seed(PART_SEED + k)(test)
    try:
        test()
        broken, detail = 0, ""
    except Exception as exc:  # noqa: BLE001  (any failure of a sequence is the verdict: named, with its program)
        broken, detail = 1, failure_detail(exc)
    if k == 0 and not broken:  # the fixed tour: every rule the stack offers, once, whatever was drawn
        try:
            tour(build, ran)
        except Exception as exc:  # noqa: BLE001  (as above: the tour's program is the detail)
            broken, detail = 1, str(exc)
        runs.append("tour")
    label = label or str(dtype).removeprefix("torch.")
    return Verdict(
        f"{label}: adapter lifecycle: rule sequences whose model left the float64 function of its current adapters "
        f"(of {len(runs)} run{f', part {k + 1} of {parts}' if parts > 1 else ''})",
        broken,
        "==",
        0,
        SOURCE,
        detail,
    )


# A fixed sequence through every rule (those a stack does not offer are left out by their preconditions), run after
# the drawn ones in part 1: the rules the draws reach vary with the seed and with the rules a stack offers (swarm
# testing enables a random subset per sequence), so without it a rule can go unjudged in a run.
TOUR: tuple[tuple[str, dict[str, object]], ...] = (
    ("train_step", {"optimizer": "adamw"}),
    ("set_mode", {"training": False}),
    ("forward", {"grad": False}),
    ("set_mode", {"training": True}),
    ("two_forwards_one_backward", {}),
    ("rescale", {"factor": 1 / 3}),
    ("disabled_forward", {"raise_inside": True}),
    ("rescale", {"factor": 2.7}),
    ("add_adapter", {"name": "second"}),
    ("switch_adapter", {"i": 1}),
    ("train_step", {"optimizer": "sgd"}),
    ("switch_adapter", {"i": 0}),
    ("delete_adapter", {"i": 0}),
    ("add_adapter", {"name": "second"}),
    ("combine_adapters", {"w": 0}),
    ("switch_adapter", {"i": 2}),
    ("train_step", {"optimizer": "adamw"}),
    ("switch_adapter", {"i": 0}),
    ("combine_adapters", {"w": 1}),
    ("save", {}),
    ("rewrite_adapters", {}),
    ("load_saved_adapter", {"into": "same model"}),
    ("checkpointed_forward", {}),
    ("cast_to_other_dtype", {}),
    ("cast_to_other_dtype", {}),
    ("merge", {}),
    ("unmerge", {}),
    ("load_saved_adapter", {"into": "fresh model"}),
)


Step = tuple[str, dict[str, object]]


def _line(name: str, kwargs: dict[str, object]) -> str:
    return f"state.{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"


def _breaks(build: Build, steps: list[Step], ran: Counter | None = None) -> tuple[BaseException, int] | None:
    """Run ``steps`` on a fresh machine of ``build`` (after ``save_at_start``), each step whose precondition holds
    followed by the check: the exception that broke it and the index of its step, or None. A step whose precondition
    does not hold is skipped (the drawn sequences never run it there)."""
    state: Any = lifecycle_machine(build, ran=ran)()  # the rules' class: its rule methods, by name
    k = -1
    try:
        state.save_at_start()
        state.check()
        for k in range(len(steps)):
            name, kwargs = steps[k]
            if NEEDS.get(name, _always)(state):
                getattr(state, name)(**kwargs)
                state.check()
    except Exception as exc:  # noqa: BLE001  (whatever broke is the finding; the caller names it)
        return exc, k
    finally:
        state.teardown()
    return None


def shrink(build: Build, steps: list[Step], kind: type[BaseException]) -> list[Step]:
    """The failing ``steps`` made smaller by deleting runs of steps (halves, then quarters, ... then single steps)
    while the sequence still breaks with a ``kind`` exception: Hypothesis' shrinking, for the fixed tour."""
    size = max(1, len(steps) // 2)
    while True:
        i = 0
        while i < len(steps):
            trial = steps[:i] + steps[i + size :]
            broke = _breaks(build, trial)
            if broke is not None and isinstance(broke[0], kind):
                steps = trial
            else:
                i += size
        if size == 1:
            return steps
        size = max(1, size // 2)


def tour(build: Build, ran: Counter | None = None) -> None:
    """``TOUR`` on a fresh machine of ``build``: each rule whose precondition holds at its turn, the check after it.
    Where it breaks, raises ``LifecycleBroken`` with the exception and the tour shrunk (``shrink``) to the steps that
    still break it, in ``replay``'s form."""
    steps = list(TOUR)
    broke = _breaks(build, steps, ran)
    if broke is None:
        return
    exc, k = broke
    shrunk = shrink(build, steps[: k + 1], type(exc))
    lines = ["state.save_at_start()", *(_line(n, a) for n, a in shrunk)]
    program = "\n".join(["state = AdapterLifecycle()", *(f"{line}\nstate.check()" for line in lines)])
    raise LifecycleBroken(
        f"{type(exc).__name__}: {exc}\nshrunk sequence of the fixed tour (lifecycle.TOUR; rerun it with "
        f"lora_suite.judges.lifecycle.replay):\n{program}"
    ) from exc


def replay(build: Build, program: str) -> None:
    """Run a printed program (``failure_detail``'s lines ``state.<rule>(name=literal, ...)``) on a fresh machine of
    ``build``; it raises what the failing sequence raised. Lines that are not a call on ``state`` are skipped."""
    state = lifecycle_machine(build)()
    try:
        for line in program.splitlines():
            line = line.strip()
            if not line.startswith("state.") or line == "state.teardown()":
                continue
            call = ast.parse(line, mode="eval").body
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute) or call.args:
                raise ValueError(f"{line!r}: expected state.<rule>(name=literal, ...)")
            if any(k.arg is None for k in call.keywords):  # a **mapping: no name=literal
                raise ValueError(f"{line!r}: expected state.<rule>(name=literal, ...)")
            kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg is not None}
            getattr(state, call.func.attr)(**kwargs)
    finally:
        state.teardown()
