"""What a GPU card's memory holds besides torch's allocator, in the units the suite states memory in (imports no
torch: the command line reads it before any run)."""

from __future__ import annotations

GIB = 2**30
# The CUDA context is outside torch's allocator but counts against NVML's free memory and a card's size: 0.6 GiB,
# typical for CUDA 12/13 with cuBLAS loaded (lora_suite/measure/memory.py says how it was taken)
CONTEXT_BYTES = int(0.6 * GIB)
# The name of the failed check an out-of-memory leaves in a run report starts with this (lora_suite/measure/oom.py)
OOM_CHECK = "CUDA out of memory"
# The name of the check a test run again by --oom-retry records (lora_suite/harness/oom_retry.py): a pass with one is
# PASS (RETRIED), never an ordinary PASS
RETRIED_CHECK = "micro-batch halved after a CUDA out of memory (--oom-retry)"
