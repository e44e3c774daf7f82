"""A CUDA out-of-memory in a tier as a verdict, not a crash (issue 56, item 7): where it struck, what held the
memory, the estimate against what was measured, and what would fit.

- ``oom_site``: the optimizer step and the phase, read from the exception's traceback through the trainer
  (``lora_suite.engine.trainer``): ``TrainingRun.step``'s ``step``; the innermost trainer line it passed (the
  forward or backward of ``accumulate_gradients``, the clipping, the optimizer step, a CUDA graph's capture or
  replay); outside the loop, "building the model or a reference".
- ``largest_live_tensors``: the tensors alive on the device when it struck (the exception's frames still hold the
  step's), the largest first, one per storage (views share theirs), each with its owner: a parameter or buffer by its
  name in the model that holds it, its gradient, an optimizer's state of it; else "no owner found" (an activation, a
  cache, a workspace).
- ``what_would_fit``: the tier's settings with the micro-batch halved (and the accumulation doubled: the same
  effective batch), the sequence halved, or gradient checkpointing on, each estimated
  (``memory.estimate_training_memory``) against the card's capacity.

``oom_detail`` puts them in one text: the check's detail in the report. The plugin (``harness/plugin/outcomes.py``)
then drops the exception's frames and empties torch's cache, so the tests after it find the GPU released.
"""

from __future__ import annotations

import dataclasses
import gc
import linecache
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from lora_suite.measure.card import GIB, OOM_CHECK

if TYPE_CHECKING:
    from lora_suite.measure.memory import MemoryEstimate
    from lora_suite.settings.config import TierConfig

TRAINER = Path(__file__).resolve().parents[1] / "engine" / "trainer.py"
# (class or "", function of the trainer, text of its line, phase): the innermost trainer frame that matches names it
PHASES = (
    ("", "accumulate_gradients", ".backward(", "backward"),
    ("", "accumulate_gradients", "model(", "forward"),
    ("CapturedStep", "__init__", "", "CUDA graph capture of the step"),
    ("CapturedStep", "run", "replay", "CUDA graph replay of the step"),
    ("TrainingRun", "_eager_update", "clip_gradients", "gradient clipping"),
    ("TrainingRun", "_eager_update", "optimizer.step", "optimizer step"),
)
OUTSIDE = "outside the training loop (building the model, its adapters or a reference)"


def oom_site(tb) -> tuple[int | None, str]:
    """(optimizer step or None, phase) of the traceback ``tb`` (module docstring)."""
    step, phase = None, OUTSIDE
    for frame, lineno in traceback.walk_tb(tb):
        code = frame.f_code
        if Path(code.co_filename).resolve() != TRAINER:
            continue
        if code.co_name == "step" and type(frame.f_locals.get("self")).__name__ == "TrainingRun":
            step, phase = frame.f_locals.get("step"), "the training step"
        line, owner = linecache.getline(code.co_filename, lineno), type(frame.f_locals.get("self")).__name__
        for cls, function, text, name in PHASES:
            if code.co_name == function and text in line and (not cls or cls == owner):
                phase = name
                break
    return step, phase


def _roots(modules: list[nn.Module]) -> list[nn.Module]:
    children = {id(c) for m in modules for c in m.children()}
    return sorted((m for m in modules if id(m) not in children), key=lambda m: -sum(1 for _ in m.parameters()))


def tensor_owners(objects: list) -> dict[int, str]:
    """id of a tensor -> its owner's name, for every model and optimizer among ``objects`` (module docstring)."""
    owners: dict[int, str] = {}
    for model in _roots([o for o in objects if isinstance(o, nn.Module)]):
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            owners.setdefault(id(p), f"{type(model).__name__}.{name}")
            if getattr(p, "grad", None) is not None:
                owners.setdefault(id(p.grad), f"gradient of {type(model).__name__}.{name}")
    for opt in (o for o in objects if isinstance(o, torch.optim.Optimizer)):
        for p, state in opt.state.items():
            for key, value in state.items():
                if torch.is_tensor(value):
                    owners.setdefault(id(value), f"{type(opt).__name__} {key} of {owners.get(id(p), 'a parameter')}")
    return owners


NO_OWNER = "no owner found (an activation, a cache or a workspace)"


def largest_live_tensors(n: int = 5, device_type: str = "cuda") -> list[tuple[int, str, str]]:
    """(bytes, dtype and shape, owner) of the ``n`` largest storages alive on ``device_type``; a storage seen through
    several tensors (views) is named by the one with an owner."""
    objects = gc.get_objects()
    owners = tensor_owners(objects)
    storages: dict[tuple[int, int], tuple[int, str, str]] = {}
    for t in (o for o in objects if torch.is_tensor(o)):
        try:
            if t.device.type != device_type or t.is_meta:
                continue
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
        except RuntimeError:  # a tensor without data (a fake or functional tensor a compile left behind)
            continue
        owner = owners.get(id(t), NO_OWNER)
        if key not in storages or (storages[key][2] == NO_OWNER and owner != NO_OWNER):
            storages[key] = (storage.nbytes(), f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}", owner)
    return sorted(storages.values(), key=lambda r: -r[0])[:n]


def what_would_fit(cfg, capacity_bytes: int) -> list[str]:
    """The tier's settings (``cfg``, a TierConfig) changed one way at a time, each estimated against the card."""
    from lora_suite.measure.memory import estimate_tier

    d, t = cfg.data, cfg.train
    variants = []  # only changes that change something: no micro-batch below 1, no checkpointing turned on twice
    if d.batch_size > 1:
        label = f"micro-batch {d.batch_size // 2}, accumulation {t.grad_accum * 2} (the same effective batch)"
        variants.append((label, {"batch_size": d.batch_size // 2}))
    if d.seq_len > 1:
        variants.append((f"sequence length {d.seq_len // 2}", {"seq_len": d.seq_len // 2}))
    if not t.gradient_checkpointing:
        variants.append(("gradient checkpointing on", {"gradient_checkpointing": True}))
    out = []
    for label, change in variants:
        need = estimate_tier(cfg, **change).device_need
        out.append(f"{label}: needs ~{need / GIB:.2f} GiB, {'fits' if need <= capacity_bytes else 'does not fit'}")
    return out


@dataclasses.dataclass
class OomContext:
    """What the tier knew before it ran: its settings and estimate, and the card's capacity in bytes."""

    cfg: TierConfig | None = None
    estimate: MemoryEstimate | None = None
    capacity_bytes: int | None = None
    peak_bytes: int | None = None


def oom_where(tb) -> str:
    """Where the traceback ``tb`` ran out of memory, in words: "step 3, backward" (``oom_site``)."""
    step, phase = oom_site(tb)
    return f"{'step ' + str(step) + ', ' if step is not None else ''}{phase}"


def oom_detail(exc: BaseException, tb, ctx: OomContext, tensors: list[tuple[int, str, str]]) -> tuple[str, str]:
    """(the check's name, its detail): where, what held the memory, the estimate against the peak, what would fit."""
    name = f"{OOM_CHECK} at {oom_where(tb)}"
    lines = [str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__]
    lines += [f"live: {b / GIB:.2f} GiB {what}, {owner}" for b, what, owner in tensors]
    if ctx.estimate is not None:
        lines.append(
            f"estimate: peak {ctx.estimate.allocated_peak / GIB:.2f} GiB, need {ctx.estimate.device_need / GIB:.2f} GiB"
            + (f"; measured peak before the error {ctx.peak_bytes / GIB:.2f} GiB" if ctx.peak_bytes else "")
            + (f"; the card {ctx.capacity_bytes / GIB:.2f} GiB" if ctx.capacity_bytes else "")
        )
    if ctx.cfg is not None and ctx.capacity_bytes:
        lines += [f"would fit? {line}" for line in what_would_fit(ctx.cfg, ctx.capacity_bytes)]
    return name, "; ".join(lines)
