"""PEFT's names for an adapter's tensors, in a model and in an adapter folder, and the contract's canonical names.

A PEFT LoRA layer at ``<path>`` holds, per adapter ``<name>``: ``lora_A.<name>.weight`` (r, in) and
``lora_B.<name>.weight`` (out, r) on a linear, ``lora_embedding_A.<name>`` (r, vocab) and ``lora_embedding_B.<name>``
(hidden, r) on an embedding, ``lora_B.<name>.bias`` (out,) under ``lora_bias``, ``lora_magnitude_vector.<name>.weight``
(out,) under DoRA; a ``modules_to_save`` wrapper at ``<path>`` holds the trained copy ``modules_to_save.<name>.*``
beside ``original_module.*``. Canonical names (``LoRAImplementation.adapter_parameters`` and ``option_parameters``):

    <path>.lora_A, <path>.lora_B, <path>.lora_embedding_A, <path>.lora_embedding_B     (adapters)
    <path>.lora_bias, <path>.lora_magnitude, <path>.saved.<parameter>                   (options)

A folder (PEFT's ``adapter_model.safetensors``) keys each without the adapter's name, under ``base_model.model.``:
``lora_A.weight``, ``lora_embedding_A``, ``lora_B.bias``, ``lora_magnitude_vector``, and a saved module's own
parameter names (checked against what PEFT 0.22's ``save_pretrained`` writes).

A ``ParamWrapper`` (``target_parameters``) at ``<path>`` adapts the 3-D parameter of its innermost base layer with
``lora_A.<name>.weight`` (E·r, in) and ``lora_B.<name>.weight`` (out, r·E): its canonical names are those of a
linear at the wrapper's path (a second wrapper on the same experts sits at ``<path>.base_layer``), its folder keys
likewise; ``expert_a`` and ``expert_b`` read them per expert as PEFT's ``get_delta_weight`` does."""

from __future__ import annotations

import functools
import re

PARAM = re.compile(
    r"^(?P<path>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector|modules_to_save)"
    r"\.(?P<adapter>[^.]+)(?:\.(?P<rest>.+))?$"
)
ADAPTER_KINDS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
# canonical suffix -> the folder key's suffix
FOLDER_SUFFIX = {
    "lora_A": "lora_A.weight",
    "lora_B": "lora_B.weight",
    "lora_embedding_A": "lora_embedding_A",
    "lora_embedding_B": "lora_embedding_B",
    "lora_bias": "lora_B.bias",
    "lora_magnitude": "lora_magnitude_vector",
}
SAVED = ".saved."


def canonical(name: str) -> tuple[str, str, str] | None:
    """(canonical name, adapter name, "adapter" or "option") of a PEFT parameter name, or None for any other."""
    m = PARAM.match(name)
    if m is None:
        return None
    path, kind, rest = m["path"], m["kind"], m["rest"]
    if kind == "modules_to_save":
        return f"{path}{SAVED}{rest}", m["adapter"], "option"
    if kind == "lora_magnitude_vector" and rest == "weight":
        return f"{path}.lora_magnitude", m["adapter"], "option"
    if kind == "lora_B" and rest == "bias":
        return f"{path}.lora_bias", m["adapter"], "option"
    if kind in ADAPTER_KINDS and rest in (None, "weight"):
        return f"{path}.{kind}", m["adapter"], "adapter"
    return None


def owner(name: str) -> str:
    """The module path a canonical ``name`` belongs to (a LoRA layer, or a saved module's wrapper)."""
    return name.split(SAVED, 1)[0] if SAVED in name else name.rsplit(".", 1)[0]


def folder_key(name: str, prefix: str) -> str:
    """The folder key of the canonical ``name`` (``prefix``: PEFT's ``base_model.model.``)."""
    if SAVED in name:
        path, rest = name.split(SAVED, 1)
        return f"{prefix}{path}.{rest}"
    path, kind = name.rsplit(".", 1)
    if kind not in FOLDER_SUFFIX:
        raise ValueError(f"{name!r} is not a canonical adapter name (ends in one of {sorted(FOLDER_SUFFIX)})")
    return f"{prefix}{path}.{FOLDER_SUFFIX[kind]}"


def expert_a(t, experts: int):
    """PEFT's ParamWrapper A (E·r, in), or its gradient, as (E, r, in): expert e's rows e·r .. (e+1)·r."""
    return t.reshape(experts, t.shape[0] // experts, t.shape[1])


def expert_b(t, experts: int):
    """PEFT's ParamWrapper B (out, r·E), or its gradient, as (E, out, r): expert e's columns e, e+E, e+2E, ..."""
    return t.reshape(t.shape[0], t.shape[1] // experts, experts).permute(2, 0, 1)


def expert_adapters(model, held: dict) -> dict:
    """The ``ExpertAdapter`` of each ParamWrapper whose A and B are in ``held`` (canonical names, the wrapper's
    path): A (E·r, in) read as (E, r, in), B (out, r·E) as (E, out, r), keyed by the parameter's name in the
    un-adapted model (the wrappers' ``base_layer`` steps left out)."""
    from lora_suite.implementations.contract import ExpertAdapter

    out = {}
    for path in sorted({owner(n) for n in held}):
        m = model.get_submodule(path)
        e = int(m.num_experts)
        name = ".".join(part for part in path.split(".") if part != "base_layer") + "." + m.parameter_name
        out[name] = ExpertAdapter(
            held[f"{path}.lora_A"],
            held[f"{path}.lora_B"],
            functools.partial(expert_a, experts=e),
            functools.partial(expert_b, experts=e),
        )
    return out
