"""The suite's command-line options, as pytest sees them (README lists them)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from lora_suite.settings.memory_options import MEMORY_OPTIONS


def _memory_options(group) -> None:
    """The options of the card's memory (``lora_suite.settings.memory_options``: the CLI declares the same)."""
    for option in MEMORY_OPTIONS:
        group.addoption(option.name, **option.kwargs())


def pytest_addoption(parser: pytest.Parser) -> None:
    """The ``lora-gpu-suite`` group of options."""
    group = parser.getgroup("lora-gpu-suite")
    _memory_options(group)
    group.addoption(
        "--report-dir", default=None, help="write report.json / report.md (+ plots) of this run into this directory"
    )
    group.addoption(
        "--lora-impl",
        default=None,
        metavar="NAME|MODULE:FACTORY",
        help="the LoRA implementation under test: cupy (default), cupy-fused, torch, peft, an entry point of the "
        "group lora_suite.implementations, or package.module:factory",
    )
    group.addoption(
        "--fused-ops",
        default=None,
        choices=("liger",),
        help="apply fused non-LoRA ops to the model under test: liger (Liger-Kernel's RMSNorm, RoPE, SwiGLU where the "
        "MLP is not fused already, fused linear cross-entropy; captured steps leave that loss out and say so)",
    )
    group.addoption(
        "--bench-impls",
        default=None,
        type=_impl_list,
        metavar="A,B,...",
        help="the interleaved training benchmark: the implementations that take turns (PEFT always "
        "joins first: the ratios are to it); default peft,torch,cupy",
    )
    group.addoption(
        "--weights",
        default=None,
        choices=("auto", "pretrained", "random"),
        help="override every tier's model weights mode",
    )
    group.addoption(
        "--gpus",
        default=None,
        type=int,
        metavar="N",
        help="multigpu tier: GPUs (torchrun processes) per job; default every visible GPU",
    )
    _multinode_options(group)
    group.addoption(
        "--plant-repeats",
        default=1,
        type=_positive_int,
        metavar="N",
        help="selftest-gpu: run each repeatable planted defect N times (each must be caught every time)",
    )


def _multinode_options(group) -> None:
    """The multinode tier's topology: nodes per job, and across hosts this host's node, node 0's address and a folder
    every node sees (lora_suite/scenarios/multinode.py)."""
    group.addoption("--nodes", default=None, type=int, metavar="N", help="multinode tier: nodes per job (default 2)")
    group.addoption(
        "--node-rank",
        default=None,
        type=int,
        metavar="K",
        help="multinode tier across hosts: the node this host runs (0 judges; with --rdzv-endpoint)",
    )
    group.addoption(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="multinode tier across hosts: node 0's address, where the nodes meet; without it one host runs every node",
    )
    group.addoption(
        "--shared-dir",
        default=None,
        metavar="DIR",
        help="multinode tier across hosts: a folder every node sees (the jobs' checkpoints and records)",
    )


def _impl_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(","))
    if not text.strip() or not all(re.fullmatch(r"[A-Za-z0-9_.:-]+", n) for n in names):
        raise argparse.ArgumentTypeError(f"expected implementation names separated by commas, got {text!r}")
    return names


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"expected a whole number >= 1, got {text!r}")
    return value


def check_report_dir(path: str) -> None:
    """Fail before anything runs when the report directory cannot be created or written."""
    target = Path(path)
    try:
        target.mkdir(parents=True, exist_ok=True)
        probe = target / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise pytest.UsageError(f"--report-dir {path}: not a writable directory ({exc.strerror or exc})") from None
