"""A fused-table run in a child process of its own, for the stacks that patch transformers for their whole process
(``fused_table.ISOLATED``: Unsloth): ``eager_in_child`` (its timed eager steps, ``EagerFigures``) and
``profile_in_child`` (its kernel profile, ``step_profile.StepProfile``) start ``child_main`` in a fresh Python, which
imports the implementation first, builds and measures the stack as ``fused_table`` does in-process, and prints its
figures as JSON on one line marked ``CHILD_MARK``; ``parse_child_output`` reads that line back, or raises with the
end of the child's output."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from typing import Any

from lora_suite.scenarios import step_profile as SP
from lora_suite.scenarios.fused_table import STACKS, EagerFigures, eager_run, stack_config, stack_model
from lora_suite.scenarios.training_bench import Case

CHILD_MARK = "lora_suite fused table figures: "
CHILD_MODES = ("eager", "profile")


def eager_in_child(
    case: Case, stack: str, *, warmup: int, measured: int, quantize: str | None = None, timeout_s: float = 900
) -> EagerFigures:
    """``eager_run`` of ``stack`` on ``case`` (its base quantised as ``quantize`` says) in a fresh Python process
    (``ISOLATED`` stacks): the child imports the implementation first (``preload``), builds, measures and prints its
    figures on one marked line. A child that fails raises a RuntimeError carrying the end of its output."""
    args = {"mode": "eager", "warmup": warmup, "measured": measured, "quantize": quantize}
    return _in_child(case, stack, args, timeout_s, lambda data: EagerFigures(**data))


def profile_in_child(
    case: Case,
    stack: str,
    *,
    warmup: int,
    measured: int,
    quantize: str | None = None,
    steps: int = 3,
    timeout_s: float = 900,
) -> SP.StepProfile:
    """``step_profile.profile_steps`` of ``stack`` on ``case`` in a fresh Python process (``ISOLATED`` stacks), the
    child built as ``eager_in_child``'s: its kernel time by kind, its top kernels and host ops
    (``step_profile.profile_to_json``) and its eager step's span. A failing child raises a RuntimeError carrying
    the end of its output."""
    args = {"mode": "profile", "warmup": warmup, "measured": measured, "quantize": quantize, "steps": steps}
    return _in_child(case, stack, args, timeout_s, SP.profile_from_json)


def _in_child(case: Case, stack: str, args: dict, timeout_s: float, read):
    """``child_main`` run with ``args`` (its mode and figures) in a fresh Python process; its marked line read by
    ``read`` (``parse_child_output``)."""
    payload = json.dumps({"case": dataclasses.asdict(case), "stack": stack, **args})
    code = "import sys; from lora_suite.scenarios.fused_child import child_main; child_main(sys.argv[1])"
    proc = subprocess.run(
        [sys.executable, "-c", code, payload], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    return parse_child_output(proc.returncode, proc.stdout, proc.stderr, stack, read)


def parse_child_output(returncode: int, stdout: str, stderr: str, stack: str, read=None):
    """What a child printed on its last marked line (``CHILD_MARK``), read by ``read`` (the JSON's data to the
    figures; ``EagerFigures`` by default). A child that exited non-zero or printed no marked line raises a
    RuntimeError carrying the end of its output."""
    lines = [line for line in stdout.splitlines() if line.startswith(CHILD_MARK)]
    if returncode != 0 or not lines:
        tail = (stderr or stdout).strip().splitlines()[-12:] or ["(no output)"]
        raise RuntimeError(  # the last line (the exception) first: a report keeps the message's start
            f"{stack}: the child process exited {returncode} without figures: {tail[-1]} | its output's end: "
            + " | ".join(tail[:-1])
        )
    data = json.loads(lines[-1][len(CHILD_MARK) :])
    return EagerFigures(**data) if read is None else read(data)


def child_main(args_json: str) -> None:
    """The child's side of ``eager_in_child`` (mode "eager": ``eager_run``'s figures) and ``profile_in_child`` (mode
    "profile": ``step_profile.profile_steps``' profile): the implementation imported first, then the model built
    and measured, the figures printed as JSON on one line marked ``CHILD_MARK``."""
    from lora_suite.implementations import resolve_implementation

    args = json.loads(args_json)
    mode, stack = args.get("mode", "eager"), args["stack"]
    if mode not in CHILD_MODES:
        raise ValueError(f"a fused-table child's mode is one of {CHILD_MODES}, got {mode!r}")
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in args["case"].items()}
    case = Case(**fields)
    resolve_implementation(STACKS[stack][0]).preload()
    cfg = stack_config(
        case, stack, "eager", warmup=args["warmup"], measured=args["measured"], quantize=args.get("quantize")
    )
    with stack_model(cfg, stack) as (prepared, window):
        if mode == "eager":
            out = dataclasses.asdict(eager_run(prepared, window, cfg, warmup=args["warmup"], measured=args["measured"]))
        else:
            out = SP.profile_to_json(SP.profile_steps(prepared, cfg, steps=args["steps"]))
    print(CHILD_MARK + json.dumps(out), flush=True)
