"""Stopping a launched job for good: a process and every process it started.

torchrun starts each rank in a session of its own (``start_new_session``), so killing torchrun's process group
leaves the ranks running, orphaned, holding their GPUs and ports. ``kill_tree`` walks the children first (psutil)
and kills them all.
"""

from __future__ import annotations

import signal


def kill_tree(pid: int, sig: int = signal.SIGKILL, *, include_self: bool = True) -> list[int]:
    """Send ``sig`` to every descendant of ``pid`` and then to ``pid`` (unless ``include_self`` is false); returns
    the pids signalled. The calling process, when it is one of them (a node stopping itself), goes last. Processes
    that have already gone are skipped, never an error."""
    import os

    import psutil

    try:
        root = psutil.Process(pid)
        family = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    if include_self:
        family.append(root)
    family.sort(key=lambda p: p.pid == os.getpid())  # stable: the caller last, the others in their order
    hit = []
    for proc in family:
        try:
            proc.send_signal(sig)
            hit.append(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return hit
