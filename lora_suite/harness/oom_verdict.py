"""A test stopped by a CUDA out-of-memory becomes a failed check of the run report that says why (``lora_suite.measure
.oom``: the step and phase, the largest live tensors and their owners, the tier's estimate against the measured
peak, what would fit), and the GPU is released for the tests after it: the exception's frames (which hold the step's
tensors and the model) are cleared, the garbage collected and torch's cache emptied (issue 56, item 7)."""

from __future__ import annotations

import gc
import traceback

import pytest

from lora_suite.measure.card import GIB

SOURCE = "the card's memory (--vram-limit, else the GPU's); lora_suite/measure/oom.py"


def record_oom(item: pytest.Item, excinfo: pytest.ExceptionInfo, report) -> None:
    """The failed check of ``item``'s out-of-memory (``excinfo``) in the run ``report``, then the GPU released."""
    import torch

    from lora_suite.measure.oom import OomContext, largest_live_tensors, oom_detail

    tier = getattr(item, "funcargs", {}).get("tier")
    ctx = OomContext(cfg=getattr(tier, "estimate_cfg", None), estimate=getattr(tier, "estimate", None))
    cuda = torch.cuda.is_available()
    if cuda:
        limit = item.config.getoption("vram_limit", None)
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        ctx.capacity_bytes = int(float(limit) * GIB) if limit else total
        ctx.peak_bytes = torch.cuda.max_memory_allocated()
    tensors = largest_live_tensors(device_type="cuda" if cuda else "cpu")
    name, detail = oom_detail(excinfo.value, excinfo.tb, ctx, tensors)
    report.check(item.nodeid, name, "out of memory", "==", "fits", source=SOURCE, detail=detail)
    release_gpu(excinfo.tb)


def release_gpu(tb) -> None:
    """After an out-of-memory: the traceback ``tb``'s frames cleared (they hold the step's tensors and the model),
    the garbage collected, torch's cache emptied and its peak reset, so what runs next starts on a released GPU."""
    import torch

    traceback.clear_frames(tb)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
