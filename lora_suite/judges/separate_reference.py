"""The architecture checks' float64 reference computed in a fresh Python process, for a stack that patches
transformers for the whole process (``LoRAImplementation.separate_reference``: Unsloth rewrites the model code when it
is imported, Liger replaces module-level functions and classes with Triton kernels that take no float64), so that no
float64 copy of the model can run beside it with transformers' own code.

The parent writes what the reference needs to a folder (``inputs.safetensors``: the float64 base as the case built
it, including a 4-bit stack's dequantised weights, each adapted factor rounded to the activation dtype, the ids and
the upstream gradient; ``case.json``: the architecture, the scales, which tensors are factors), runs
``python -m lora_suite.judges.separate_reference FOLDER`` (a process that imports neither the stack nor its patches),
and reads ``outputs.safetensors`` back: the logits and every factor's gradient, by the names ``reference_run`` gives.
The child builds the architecture's skeleton in float64 (``Architecture.build``), loads the base strictly, and runs
``reference_math.reference_math``, the same function the in-process reference runs. A child that fails is an error
naming its exit status and the end of what it printed, never a reference of zeros.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lora_suite.judges.reference_math import ArchCase, FunctionRun, reference_factors, reference_math

TIMEOUT_S = 600  # a tiny model in float64 on the CPU takes seconds; a child that hangs is stopped and named


def pack(case: ArchCase, folder: Path, backward: bool) -> None:
    """What the child needs, in ``folder``."""
    factors, experts = reference_factors(case)
    tensors = {f"base.{n}": t.detach().cpu().clone() for n, t in case.reference.state_dict().items()}
    tensors.update({f"buffer.{n}": t.detach().cpu().clone() for n, t in case.reference.named_buffers()})  # RoPE's too
    for path, (a, b) in factors.items():
        tensors[f"linear.{path}.lora_A"], tensors[f"linear.{path}.lora_B"] = a.cpu(), b.cpu()
    for name, (a3, b3, _) in experts.items():
        tensors[f"expert.{name}.lora_A"], tensors[f"expert.{name}.lora_B"] = a3.cpu(), b3.cpu()
    tensors["ids"], tensors["dlogits"] = case.ids.cpu(), case.dlogits.cpu().double()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "inputs.safetensors"))
    spec = {
        "arch": case.arch.name,
        "scale": case.scale,
        "linears": list(factors),
        "experts": {name: se for name, (_, _, se) in experts.items()},
        "backward": backward,
        "threads": torch.get_num_threads(),  # the parent's: the same sums in the same order
    }
    (folder / "case.json").write_text(json.dumps(spec))


def run(case: ArchCase, *, backward: bool = True) -> FunctionRun:
    """``model_function.reference_run`` of ``case``, computed in a fresh process; results on ``case``'s device."""
    folder = Path(tempfile.mkdtemp(prefix="lora-reference-"))
    try:
        pack(case, folder, backward)
        done = subprocess.run(
            [sys.executable, "-m", "lora_suite.judges.separate_reference", str(folder)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise RuntimeError(
                f"the float64 reference of {case.arch.name} in a fresh process exited with {done.returncode}: "
                + " | ".join(tail)
            )
        out = load_file(str(folder / "outputs.safetensors"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    device = case.ids.device
    grads: dict[str, torch.Tensor | None] = {k[len("grad.") :]: v.to(device) for k, v in out.items() if k != "logits"}
    return FunctionRun(out["logits"].to(device), grads)


def compute(folder: Path) -> None:
    """The child's work: the reference of the case packed in ``folder``, written to ``outputs.safetensors``."""
    from lora_suite.engine.architectures import ARCHITECTURES

    spec = json.loads((folder / "case.json").read_text())
    torch.set_num_threads(spec["threads"])
    t = load_file(str(folder / "inputs.safetensors"))
    reference = ARCHITECTURES[spec["arch"]].build(torch.float64, "cpu", seed=0).requires_grad_(False)
    reference.load_state_dict({k[len("base.") :]: v for k, v in t.items() if k.startswith("base.")}, strict=True)
    with torch.no_grad():  # the buffers as the parent's reference holds them (non-persistent ones: not in the state)
        for k, v in t.items():
            if k.startswith("buffer."):
                reference.get_buffer(k[len("buffer.") :]).copy_(v)
    factors = {p: (t[f"linear.{p}.lora_A"], t[f"linear.{p}.lora_B"]) for p in spec["linears"]}
    experts = {n: (t[f"expert.{n}.lora_A"], t[f"expert.{n}.lora_B"], se) for n, se in spec["experts"].items()}
    result = reference_math(reference, factors, experts, spec["scale"], t["ids"], t["dlogits"], spec["backward"])
    out = {"logits": result.logits.contiguous()}
    out.update({f"grad.{n}": g.contiguous() for n, g in result.grads.items() if g is not None})
    save_file(out, str(folder / "outputs.safetensors"))


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit(
            f"usage: python -m lora_suite.judges.separate_reference FOLDER (a folder written by pack), got {sys.argv[1:]}"
        )
    compute(Path(sys.argv[1]))
