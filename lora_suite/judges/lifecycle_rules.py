"""The rules of the adapter lifecycle's state machine (``lora_suite.judges.lifecycle`` runs it; its docstring lists
the rules): each rule a method of ``_Rules`` over one ``lifecycle_state.Lifecycle``, its precondition a named
function here (the fixed tour, ``lifecycle.tour``, asks the same ones), and ``lifecycle_machine`` the class of one
build (which rules the implementation offers)."""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lora_suite.judges import lifecycle_ops as LO
from lora_suite.judges.lifecycle_state import PARTNER, Build, Lifecycle

ADAPTER_NAMES = ("second", "third")  # the adapters the rules add beside "default" (a name added again is reused)
# The factors the rescale rule sets (set_adapter_scale): inexact in every binary format but 0.5 and 1 (which restores)
FACTORS = (0.5, 1.0, 1 / 3, 2.7)
# The weights the combination rule gives its two sources (the active adapter, another): negative, inexact, one of 1
WEIGHTS = ((0.7, -1.3), (1.0, 0.3), (-0.45, 2.0))


def _counted(method):
    """A rule that counts its calls in ``self.ran`` (which rules the sequences reached)."""

    @functools.wraps(method)
    def counted(self, **kw):
        self.ran[method.__name__] += 1
        return method(self, **kw)

    return counted


def _unmerged(self) -> bool:
    return self.life.merged is None


def _can_merge(self) -> bool:
    return self.can_merge and self.life.merged is None


def _can_unmerge(self) -> bool:
    return self.can_unmerge and self.life.merged is not None


def _can_disable(self) -> bool:
    return self.can_disable and self.life.merged is None


def _can_rescale(self) -> bool:
    return self.can_rescale and self.life.merged is None


def _can_add(self) -> bool:
    return self.can_hold_several and self.life.merged is None


def _two_held(self) -> bool:
    return _can_add(self) and len(self.life.present) > 1


def _can_combine(self) -> bool:
    """Two adapters to combine, the active one not the combined one (its name is reused by deleting it)."""
    life = self.life
    others = [n for n in life.present if n not in (life.active, LO.COMBINED)]
    return self.can_combine and _two_held(self) and life.active != LO.COMBINED and bool(others)


def _saved(self) -> bool:
    return self.life.saved is not None


def _can_cast(self) -> bool:
    return self.can_cast and self.life.merged is None and not self.life.unmerged


class _Rules(RuleBasedStateMachine):
    """The rules; ``lifecycle_machine`` makes the class of one build (``build``, ``can_merge``, ``can_cast``, ``runs``,
    ``ran`` set on it)."""

    build: Build
    can_merge = can_cast = can_unmerge = can_disable = can_rescale = can_hold_several = can_combine = False
    runs: list | None = None
    ran: Counter

    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="lora-lifecycle-"))
        self.life = Lifecycle(self.build, self.dir)
        if self.runs is not None:
            self.runs.append(self)

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    @invariant()
    def check(self):
        self.life.check()

    @initialize()
    @_counted
    def save_at_start(self):
        """A checkpoint of the starting adapters (so that a load can come at any point of a sequence)."""
        self.life.save()

    @precondition(_unmerged)
    @rule(optimizer=st.sampled_from(("sgd", "adamw")))
    @_counted
    def train_step(self, optimizer):
        self.life.train_step(optimizer, self.life.next_seed())

    @rule(grad=st.booleans())
    @_counted
    def forward(self, grad):
        mode = "train" if self.life.training else "eval"
        self.life.forward(self.life.next_seed(), grad=grad, what=f"forward in {mode} mode, grad {grad}")

    @rule(training=st.booleans())
    @_counted
    def set_mode(self, training):
        self.life.set_mode(training)

    @precondition(_unmerged)
    @rule()
    @_counted
    def two_forwards_one_backward(self):
        self.life.two_forwards(self.life.next_seed())

    @rule()
    @_counted
    def checkpointed_forward(self):
        self.life.checkpointed(self.life.next_seed())

    @precondition(_unmerged)
    @rule()
    @_counted
    def rewrite_adapters(self):
        self.life.rewrite(self.life.next_seed())

    @precondition(_can_merge)
    @rule()
    @_counted
    def merge(self):
        self.life.merge()
        self.life.check()  # the merged function, then a second merge: nothing folded twice (checked after the rule)
        LO.merge_again(self.life)

    @precondition(_can_unmerge)
    @rule()
    @_counted
    def unmerge(self):
        LO.unmerge(self.life)

    @precondition(_can_disable)
    @rule(raise_inside=st.booleans())
    @_counted
    def disabled_forward(self, raise_inside):
        LO.disabled_forward(self.life, self.life.next_seed(), raise_inside)

    @precondition(_can_rescale)
    @rule(factor=st.sampled_from(FACTORS))
    @_counted
    def rescale(self, factor):
        LO.rescale(self.life, factor)

    @precondition(_can_add)
    @rule(name=st.sampled_from(ADAPTER_NAMES))
    @_counted
    def add_adapter(self, name):
        if name == self.life.active:  # the active adapter is never deleted to reuse its name: switch away first
            return
        LO.add_adapter(self.life, name, self.life.next_seed())

    @precondition(_two_held)
    @rule(i=st.integers(0, 3))
    @_counted
    def switch_adapter(self, i):
        LO.switch_adapter(self.life, self.life.present[i % len(self.life.present)])

    @precondition(_two_held)
    @rule(i=st.integers(0, 3))
    @_counted
    def delete_adapter(self, i):
        others = [n for n in self.life.present if n != self.life.active]
        LO.delete_adapter(self.life, others[i % len(others)])

    @precondition(_can_combine)
    @rule(w=st.integers(0, len(WEIGHTS) - 1))
    @_counted
    def combine_adapters(self, w):
        life = self.life
        other = next(n for n in life.present if n not in (life.active, LO.COMBINED))
        LO.combine(life, [life.active, other], WEIGHTS[w])

    @precondition(_unmerged)
    @rule()
    @_counted
    def save(self):
        self.life.save()

    @precondition(_saved)
    @rule(into=st.sampled_from(("fresh model", "same model")))
    @_counted
    def load_saved_adapter(self, into):
        if into == "same model" and self.life.merged is not None:
            into = "fresh model"  # a merged model holds no adapters to load into
        self.ran[f"load into the {into}"] += 1
        self.life.load_fresh() if into == "fresh model" else self.life.load_here()

    @precondition(_can_cast)
    @rule()
    @_counted
    def cast_to_other_dtype(self):
        self.life.to_partner_dtype()


def lifecycle_machine(
    build: Build, runs: list | None = None, ran: Counter | None = None
) -> type[RuleBasedStateMachine]:
    """The state machine class of ``build``'s probe (each instance one fresh probe; ``runs`` gets one entry per
    instance, ``ran`` each rule's calls). Merge only where the implementation merges on a 16-bit base; the dtype
    change only on a 16-bit base."""
    can_merge = build.impl.merge_reason() is None and build.spec.quantize is None
    attrs = {
        "build": build,
        "can_merge": can_merge,
        "can_unmerge": can_merge and build.impl.operation_reason("unmerge") is None,
        "can_disable": build.impl.operation_reason("disable") is None,
        "can_rescale": build.impl.operation_reason("rescale") is None,
        "can_hold_several": build.impl.operation_reason("adapters") is None,
        "can_combine": build.impl.operation_reason("adapters") is None
        and build.impl.operation_reason("combine") is None,
        "can_cast": build.spec.quantize is None and build.dtype in PARTNER,
        "runs": runs,
        "ran": Counter() if ran is None else ran,
    }
    return type("AdapterLifecycle", (_Rules,), attrs)


def _always(self) -> bool:
    return True


# rule -> its precondition (the same function its decorator takes; none: always)
NEEDS = {
    "train_step": _unmerged,
    "two_forwards_one_backward": _unmerged,
    "rewrite_adapters": _unmerged,
    "save": _unmerged,
    "merge": _can_merge,
    "unmerge": _can_unmerge,
    "disabled_forward": _can_disable,
    "rescale": _can_rescale,
    "add_adapter": _can_add,
    "switch_adapter": _two_held,
    "delete_adapter": _two_held,
    "combine_adapters": _can_combine,
    "load_saved_adapter": _saved,
    "cast_to_other_dtype": _can_cast,
}
