"""What keeps memory of an earlier run allocated: the models still alive, and what refers to them.

A run's peak is measured net of what earlier work left allocated (``PeakWindow.carried``), so a model that outlives
its run does not change the verdict, but it is memory the process holds for nothing, and a leak of the suite or of
the stack under test. Where a window opens on more than a little carried memory, ``describe_carried`` names the
live modules that hold it and what refers to each (an attribute of some object, a closure cell, a frame, a
container), after the garbage collector has run, so that the report says where to look.

Seen first in the full tier under ``--fused-ops liger`` (issue 34): the 16-bit comparison model, 13.05 GB, was still
allocated when the NF4 run's window opened; the note then named frames of its forward kept by an ImportError's
traceback, the exception an argument of a logging record the test's log capture keeps (docs/fused.md).
"""

from __future__ import annotations

import gc
import sys
import types

from torch import nn

MAX_MODULES = 3
MAX_REFERRERS = 4


def _param_bytes(module: nn.Module, device_type: str) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device.type == device_type and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def live_models(min_bytes: int, device_type: str = "cuda") -> list[tuple[nn.Module, int]]:
    """The outermost live modules whose parameters and buffers on ``device_type`` reach ``min_bytes``, largest first
    (a submodule of another such module is left out: its parent is what is alive)."""
    big = [(m, _param_bytes(m, device_type)) for m in gc.get_objects() if issubclass(type(m), nn.Module)]
    big = [(m, b) for m, b in big if b >= min_bytes]
    inner = {id(child) for m, _ in big for child in m.modules() if child is not m}
    return sorted(((m, b) for m, b in big if id(m) not in inner), key=lambda mb: -mb[1])


def _owner_object(d: dict, skip: set[int]):
    """The object whose ``__dict__`` is ``d``, or None."""
    for r in gc.get_referrers(d):
        if id(r) not in skip and getattr(r, "__dict__", None) is d:
            return r
    return None


def _frame_keeper(frame: types.FrameType, skip: set[int], depth: int = 0) -> str:
    """What keeps a finished frame alive, in words: the traceback of an exception (and what holds that exception), a
    generator, or a deeper frame's ``f_back`` (followed down to what holds the deepest one)."""
    if depth > 64:
        return ""
    for r in gc.get_referrers(frame):
        if id(r) in skip:
            continue
        if isinstance(r, types.FrameType) and r.f_back is frame:  # a call made from this frame: what keeps it?
            return _frame_keeper(r, skip | {id(frame)}, depth + 1)
        if isinstance(r, types.TracebackType):
            exc = _exception_of(r, skip)
            if exc is None:
                return ", kept by a traceback"
            holders = [h for h in gc.get_referrers(exc) if id(h) not in skip and not isinstance(h, types.TracebackType)]
            own = skip | {id(frame), id(holders)}  # this list holds them too
            held = describe_referrer(holders[0], exc, own) if holders else "nothing the collector sees"
            return f", kept by the traceback of {type(exc).__name__}({str(exc)[:160]!r}) held by {held}"
        if isinstance(r, types.GeneratorType | types.CoroutineType):
            return f", kept by the generator {r.__qualname__}"
    return ""


def _exception_of(tb: types.TracebackType, skip: set[int]) -> BaseException | None:
    """The exception whose ``__traceback__`` chain reaches ``tb`` (tracebacks link outermost to innermost)."""
    for _ in range(256):
        up = [r for r in gc.get_referrers(tb) if id(r) not in skip]
        exc = next((r for r in up if isinstance(r, BaseException) and r.__traceback__ is tb), None)
        if exc is not None:
            return exc
        outer = next((r for r in up if isinstance(r, types.TracebackType) and r.tb_next is tb), None)
        if outer is None:
            return None
        tb = outer
    return None


def describe_referrer(r, target, skip: set[int], hops: int = 3) -> str:
    """How ``r`` refers to ``target``, in words: a frame with what keeps it alive after its call ended; a container,
    a dict or an object's attribute followed up to ``hops`` holders further (``_holder``). Plain loops throughout:
    a comprehension naming ``target`` would hold it in a cell of its own (Python 3.11)."""
    if isinstance(r, types.FrameType):
        where = f"a frame of {r.f_code.co_name} ({r.f_code.co_filename}:{r.f_lineno})"
        return where + _frame_keeper(r, skip)
    if isinstance(r, types.CellType):
        closures = [t for t in gc.get_referrers(r) if isinstance(t, tuple)]  # a function's __closure__
        funcs = [f for t in closures for f in gc.get_referrers(t) if isinstance(f, types.FunctionType)]
        return f"a closure cell of {funcs[0].__qualname__ if funcs else 'a function'}"
    if isinstance(r, types.MethodType):
        return f"a bound method {r.__func__.__qualname__}"
    if isinstance(r, types.FunctionType):
        return f"the function {r.__qualname__}"
    up = skip | {id(target)}
    if isinstance(r, dict):
        key = _key_of(r, target)
        for m in gc.get_referrers(r):
            if isinstance(m, types.ModuleType) and vars(m) is r:
                return f"the global {key} of {m.__name__}"
        owner = _owner_object(r, skip)
        if owner is not None:
            return f"attribute {key!r} of a {type(owner).__name__}" + _holder(owner, up | {id(r)}, hops)
        return (f"a dict under {key!r}" if key is not None else f"a dict of {len(r)} items") + _holder(r, up, hops)
    if isinstance(r, list | tuple | set):
        return f"a {type(r).__name__} of {len(r)} items" + _holder(r, up, hops)
    attr = None if isinstance(r, type) else _key_of(getattr(r, "__dict__", {}), target)
    if attr is not None:  # an instance whose attributes live inline (Python 3.11+ reports the object, not its __dict__)
        return f"attribute {attr!r} of a {type(r).__name__}" + _holder(r, up, hops)
    return f"a {type(r).__name__}"


def _key_of(d: dict, value):
    for k, v in d.items():
        if v is value:
            return k
    return None


def _holder(obj, skip: set[int], hops: int) -> str:
    """ ", held by ..." for what holds ``obj`` (``describe_referrer`` of its first referrer that is not this search's
    own: a frame on this call stack, a list of referrers made here), or "" once ``hops`` are spent."""
    if hops <= 0:
        return ""
    stack: set[int] = set()
    frame: types.FrameType | None = sys._getframe()
    while frame is not None:  # this call's own frames refer to obj as a local
        stack.add(id(frame))
        frame = frame.f_back
    refs = gc.get_referrers(obj)
    up = skip | {id(obj), id(refs)}  # this list holds the next level's object too
    for h in refs:
        if id(h) not in skip and id(h) not in stack:
            said = describe_referrer(h, obj, up, hops - 1)
            return (", " if said.startswith("the global") else ", held by ") + said
    return ""


def describe_carried(min_bytes: int = 256 * 2**20, device_type: str = "cuda") -> list[str]:
    """For each live outermost module holding at least ``min_bytes`` (at most ``MAX_MODULES``): its class, its bytes
    and what refers to it (at most ``MAX_REFERRERS`` referrers)."""
    gc.collect()
    lines = []
    found = live_models(min_bytes, device_type)[:MAX_MODULES]
    own = {id(sys._getframe()), id(found)} | {id(pair) for pair in found}  # this call's own references
    for module, nbytes in found:  # plain loops: a comprehension over ``module`` would be a closure holding it
        said: list[str] = []
        for r in gc.get_referrers(module):
            if id(r) not in own and len(said) < MAX_REFERRERS:
                said.append(describe_referrer(r, module, own))
        lines.append(
            f"{type(module).__name__} ({nbytes / 2**20:.1f} MiB) referred to by "
            + ("; ".join(said) if said else "nothing the collector sees (a C extension holds it)")
        )
    return lines


def carried_note(carried_bytes: int, min_bytes: int = 256 * 2**20, device_type: str = "cuda") -> str:
    """The words a report note adds where a window opened on ``min_bytes`` or more carried: what holds it (modules
    of a quarter of that or more)."""
    if carried_bytes < min_bytes:
        return ""
    held = describe_carried(min_bytes // 4, device_type)
    return "; still alive: " + (" | ".join(held) if held else "no module (tensors held elsewhere)")
