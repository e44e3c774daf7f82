"""A dequantised NF4 base kept from a checkpointed layer's recompute to that layer's backward.

A QLoRA base Ŵ = dequant(W_nf4) (O, K) is needed by every GEMM that reads it: y = x Ŵᵀ forward and
dx = dY Ŵ backward. Under activation checkpointing a layer's forward runs twice per step, so a step used to
dequantise each base three times:

    forward pass     y = x Ŵᵀ      saved tensors dropped by the checkpoint
    recompute        y = x Ŵᵀ      inside the backward pass, just before this layer's backward
    backward         dx = dY Ŵ

The dequantisation is deterministic, so the recompute's Ŵ is bit for bit the one the backward would make. A
forward that runs inside a backward pass (``in_recompute``) therefore keeps its Ŵ (``keep``), and the backward
takes it (``take``) instead of dequantising again: two dequantisations per base per step instead of three. The
price is memory: the bases of one checkpointed region live from its recompute to their backward (Llama-2-7B, one
decoder layer: at most 7 bases, 202 M elements, 0.38 GiB in bf16) instead of one base's scratch at a time.

Why a table and not the autograd context: non-reentrant checkpointing runs the backward of the *first* forward's
graph and only feeds it the recomputed saved tensors, matched by position, so a recompute cannot save a tensor the
first forward did not. The table is keyed by the NF4 weight's packed codes: the module's buffer tensor, the same
object in both forwards where the ``NF4Tensor`` wrapper is made anew at each call (an entry holds that buffer, so
its identity cannot pass to another tensor while the entry lives), a role and the dtype. ``take`` removes the
entry; every entry a backward pass left untaken (a node the backward never reached) is dropped when that backward
pass ends (an engine callback), and the table holds at most ``MAX_HELD`` entries (the oldest dropped first: a
Llama layer keeps at most 7), so nothing outlives the pass and a recompute whose bases are never taken (a wrapper
that gathers its codes anew at each call, say) cannot pile them up.

Nothing is kept outside a backward pass: a plain forward (no checkpointing) dequantises into scratch and frees it,
and its backward dequantises again, as before; a checkpointed region's first forward keeps nothing either. A base
is kept only where its backward will read it (dx is needed, or a fused op's inner gradient reads it).

"Inside a backward pass" is the autograd engine's graph task on this thread (``torch._C._current_graph_task_id``,
-1 outside one), what ``torch.utils.checkpoint`` itself reads; both checkpoint flavours (reentrant and not)
recompute inside it. ``reuse_counts`` says how often a base was kept and taken, so reports can show the path ran;
``reuse_disabled`` turns it off (the same step measured both ways in one run).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter

import torch

_counts: Counter[str] = Counter()
_enabled = True
_lock = threading.Lock()
MAX_HELD = 32
_kept: dict[tuple, tuple[int, torch.Tensor, torch.Tensor]] = {}  # (id(codes), role, dtype) -> (task, Ŵ, codes)
_tasks_with_cleanup: set[int] = set()


def in_recompute() -> bool:
    """True while this thread runs a forward inside an autograd backward pass (a checkpointed recompute)."""
    return _enabled and torch._C._current_graph_task_id() != -1


def _key(nf4, role: str, dtype: torch.dtype) -> tuple:
    """The weight's identity across calls: its packed codes buffer, not the wrapper object."""
    return (id(nf4.packed), role, dtype)


def keep(nf4, role: str, w: torch.Tensor, needed: bool = True) -> None:
    """Keep ``w``, the dequantised ``nf4`` base (``role`` tells bases of one weight apart), for the backward that
    follows, if this forward is a recompute and ``needed`` (that backward reads it)."""
    if not (needed and in_recompute()):
        return
    task = torch._C._current_graph_task_id()
    with _lock:
        key = _key(nf4, role, w.dtype)
        if _kept.pop(key, None) is not None:  # kept again before its backward took it: the older one is dropped
            _counts["dropped"] += 1
        _kept[key] = (task, w, nf4.packed)
        _counts["kept"] += 1
        while len(_kept) > MAX_HELD:  # dicts keep insertion order: the oldest first
            del _kept[next(iter(_kept))]
            _counts["dropped"] += 1
        first = task not in _tasks_with_cleanup
        _tasks_with_cleanup.add(task)
    if first:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _drop_task(task))


def take(nf4, role: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The base a recompute kept for this backward (removed from the table), or None: dequantise it."""
    if not _kept:  # every backward without checkpointing: no lock on the step's path
        return None
    with _lock:
        entry = _kept.pop(_key(nf4, role, dtype), None)
        if entry is not None:
            _counts["taken"] += 1
    return None if entry is None else entry[1]


def _drop_task(task: int) -> None:
    with _lock:
        for key in [k for k, (t, *_) in _kept.items() if t == task]:
            del _kept[key]
            _counts["dropped"] += 1
        _tasks_with_cleanup.discard(task)


def reuse_counts() -> dict[str, int]:
    """In this process: bases kept by a recompute, taken by their backward, and dropped untaken at a backward
    pass's end; ``held`` is what the table holds now (0 outside a backward pass)."""
    with _lock:
        return {"kept": _counts["kept"], "taken": _counts["taken"], "dropped": _counts["dropped"], "held": len(_kept)}


@contextlib.contextmanager
def reuse_disabled():
    """Within the block every pass dequantises its own base (three per base per checkpointed step)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before
