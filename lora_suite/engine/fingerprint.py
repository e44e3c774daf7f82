"""What an implementation computes, as hashes: the equivalence rule of ``lora-suite mutate``.

A mutant that survives the checks is *equivalent* when its fingerprint equals the unmutated source's, bit for bit:
on a small probe block (``lora_suite.engine.probes``) with fixed seeds, in fp32 and in bf16 (and fp32 with rsLoRA
where the implementation has it, and fp32 over base layers with a bias where it adapts them),

- ``init``: the adapters as ``inject`` made them (``build_probe(randomise=False)``, which seeds torch first, so random
  inits repeat);
- ``forward+backward``: every output and every gradient (inputs and adapters) of one forward and backward, the
  adapters set to the probe's random values;
- ``served_by``: what the implementation says served that forward;
- ``saved folder``: what every file ``save_adapter`` writes holds: a JSON file's parsed content (its whitespace and
  key order are not content), a safetensors file's tensors (names, dtypes, shapes, bytes) and metadata, any other
  file's bytes;
- ``loaded``: the outputs of a fresh block (same base, adapters zeroed) after ``load_adapter`` of that folder;
- ``merged``: the outputs after ``merge_adapters``, where the implementation has one.

An exception is part of the fingerprint (its type and message), so a mutant that raises where the source does not
differs. Each part is a SHA-256 over dtypes, shapes and bytes.

Run as a process of its own on the device the checks used (``lora_suite.mutation.mutant_source.fingerprint_command``):
it prints one JSON object, part -> digest. The mutant replaces its module there through ``lora_suite.mutation.mutant_source`` before this module
imports any implementation.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

PROBE_SEED = 7
N_SHAPE = (2, 5)  # tokens: (batch, sequence) of the probe's inputs
DTYPES = ("float32", "bfloat16")
# alpha / r = 7/3 (and 7/sqrt(3) under rsLoRA) is exact in no float format: a scale or a value rounded through bf16
# on an fp32 path changes the fp32 configurations' digests (lora_value_operators.LowPrecisionRoundTrip)
RANK, ALPHA = 3, 7.0


def _digest(items) -> str:
    import torch

    h = hashlib.sha256()
    for name, t in items:
        h.update(name.encode())
        if t is None:
            h.update(b"<none>")
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _guarded(fn) -> str:
    """``fn()``'s digest, or the exception it raised (type and message)."""
    try:
        return fn()
    except Exception as exc:  # the exception is the part's value: a mutant that raises differs from one that does not
        return f"raised {type(exc).__name__}: {exc}"


BIAS = "+bias"  # the label of the configuration whose base layers carry a bias (lora_value_operators.DropBias)


def configurations(impl) -> dict[str, tuple[str, bool, bool]]:
    """label -> (dtype name, rsLoRA, base bias): fp32 and bf16; fp32 with rsLoRA where the implementation has it; fp32
    over base layers with a bias where it adapts such layers on a floating base (``linear_bias``, ``bf16_base``)."""
    out = {name: (name, False, False) for name in DTYPES}
    if impl.reason_not_applicable("rslora") is None:
        out["float32+rslora"] = ("float32", True, False)
    if impl.reason_not_applicable("linear_bias") is None and impl.reason_not_applicable("bf16_base") is None:
        out[f"float32{BIAS}"] = ("float32", False, True)
    return out


def fingerprint(impl, device: str = "cuda") -> dict[str, str]:
    """part -> digest (module docstring) of ``impl`` on ``device``, each part under its configuration's label."""
    out: dict[str, str] = {}
    for label, (dtype, rslora, bias) in configurations(impl).items():
        out.update({f"{label}: {part}": v for part, v in _parts(impl, dtype, rslora, bias, device).items()})
    return out


def _parts(impl, dtype_name: str, rslora: bool, bias: bool, device: str) -> dict[str, str]:
    import torch

    from lora_suite.engine import probes as P
    from lora_suite.implementations import AdapterSpec

    shape = P.BlockShape("fingerprint", 48, 40, 16, 76, bias=bias)
    dtype = getattr(torch, dtype_name)
    spec = AdapterSpec(P.PROBE_TARGETS, RANK, ALPHA, use_rslora=rslora, adapter_dtype=dtype)
    inputs = P.random_inputs(shape, N_SHAPE, dtype, device, seed=PROBE_SEED + 1)
    out: dict[str, str] = {}
    state: dict = {}

    def init():  # build_probe seeds torch's generator first, so an implementation's random init repeats
        probe = P.build_probe(impl, shape, spec, dtype, device, seed=PROBE_SEED, randomise=False)
        return _digest(sorted(probe.adapters.items()))

    def build():
        return P.build_probe(impl, shape, spec, dtype, device, seed=PROBE_SEED)

    def forward_backward():
        state["probe"] = probe = build()
        return _digest(sorted(P.run_probe(probe, inputs).tensors().items()))

    out["init"] = _guarded(init)
    out["forward+backward"] = _guarded(forward_backward)
    out["served_by"] = _guarded(lambda: str(impl.served_by(state["probe"].block)))
    with tempfile.TemporaryDirectory(prefix="lora-suite-fingerprint-") as tmp:
        folder = Path(tmp) / "adapter"

        def saved():
            impl.save_adapter(state["probe"].block, folder)
            h = hashlib.sha256()
            for f in sorted(p for p in folder.rglob("*") if p.is_file()):
                h.update(str(f.relative_to(folder)).encode() + b"\0" + _content(f))
            return h.hexdigest()

        def loaded():
            fresh = build()
            with torch.no_grad():
                for p in fresh.adapters.values():
                    p.zero_()
            impl.load_adapter(fresh.block, folder)
            return _outputs(P, fresh, inputs)

        out["saved folder"] = _guarded(saved)
        out["loaded"] = _guarded(loaded)
    if impl.merge_reason() is None:

        def merged():
            probe = build()
            impl.merge_adapters(probe.block)
            return _outputs(P, probe, inputs)

        out["merged"] = _guarded(merged)
    return out


def _outputs(P, probe, inputs) -> str:
    import torch

    with torch.no_grad():
        run = P.run_probe(probe, inputs, inputs_require_grad=False, backward=False)
    return _digest(zip(P.OUTPUTS, run.outputs))


def differing(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """The parts whose digests differ (a part one side lacks counts)."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def main(argv: list[str] | None = None) -> None:
    """``SPEC DEVICE`` -> the fingerprint as one JSON line on stdout."""
    spec, device = (sys.argv[1:] if argv is None else argv)[:2]
    from lora_suite.implementations import resolve_implementation

    print(json.dumps(fingerprint(resolve_implementation(spec), device), sort_keys=True))


def _content(path: Path) -> bytes:
    """What a saved file holds, independent of how it was laid out: see the module's ``saved folder``."""
    if path.suffix == ".json":
        try:
            return json.dumps(json.loads(path.read_text()), sort_keys=True).encode()
        except ValueError:
            return path.read_bytes()
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        h = hashlib.sha256()
        with safe_open(str(path), framework="pt") as f:
            h.update(json.dumps(f.metadata(), sort_keys=True).encode())
            for key in sorted(f.keys()):
                h.update(_digest([(key, f.get_tensor(key))]).encode())
        return h.hexdigest().encode()
    return path.read_bytes()
