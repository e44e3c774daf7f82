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
parameter names (checked against what PEFT 0.22's ``save_pretrained`` writes)."""

from __future__ import annotations

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
