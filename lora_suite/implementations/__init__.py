"""The LoRA implementations the suite can judge, the contract they meet, and how one is chosen.

The contract (``LoRAImplementation``): given a Hugging Face causal LM and an ``AdapterSpec`` (targets, r,
alpha, rsLoRA, adapter dtype, base storage), an implementation

- ``inject(model, spec)`` puts adapters on the target linears in place, freezes everything else and returns
  the module paths it adapted (a target matching nothing is an error);
- ``adapter_parameters(model)`` lists the trainable adapter tensors under canonical names,
  ``<module path>.lora_A`` with shape (r, in) and ``<module path>.lora_B`` with shape (out, r), so that the
  suite can copy one implementation's adapters into another's and compare gradients name by name;
  the layer computes y = x Wᵀ + s·(x Aᵀ) Bᵀ with s = alpha / r (alpha / √r with rsLoRA);
- ``save_adapter(model, path)`` / ``load_adapter(model, path)`` write and read a PEFT-format folder
  (``adapter_config.json`` + ``adapter_model.safetensors`` with PEFT's key names);
- ``not_applicable`` names what it cannot do by design, with the reason (``FEATURES``); the tiers record such
  a check as not applicable in the report instead of running it or dropping it silently;
- ``served_by(model)`` says which code path served the latest forward of every adapted layer (the tiers
  compare it with ``expected_path``: no silent fallback), and ``op_calls()`` counts the LoRA op calls where
  the implementation can (None where it cannot);
- optionally, the operations a user calls on an adapted model (``OPERATIONS``): ``merge_adapters`` and
  ``unmerge_adapters``, ``disabled_adapters`` (a context: the base function inside) and ``set_adapter_scale`` (PEFT's
  ``set_scale``); one not offered is recorded not applicable with ``operation_reason`` (the stack's own reason, in
  ``operation_reasons``), and the adapter lifecycle draws the rest;
- optionally, ``load_model(model, spec)`` returns the model to inject into, for a stack that trains only models its own
  loader read (Unsloth: the suite then builds the weights into host memory a layer at a time and leaves quantisation
  to that loader), and ``preload()`` imports what must come before transformers.

Built-ins: ``cupy`` (this project's layer on its CuPy/cuBLAS backend, the default), ``torch`` (the same layer
on the torch reference backend) and ``peft`` (PEFT's LoRA layers). Others come from the entry-point group
``lora_suite.implementations`` (name -> a factory returning a ``LoRAImplementation``) or from a spec
``package.module:factory`` (``--lora-impl``).
"""

from __future__ import annotations

from lora_suite.implementations.contract import (
    DEFAULT,
    ENTRY_POINT_GROUP,
    FEATURES,
    OPERATIONS,
    AdapterSpec,
    ExpertAdapter,
    ImplementationError,
    LoRAImplementation,
    library_version,
    require_module,
)
from lora_suite.implementations.lookup import (
    BUILTINS,
    BUNDLED,
    check_contract,
    entry_point_names,
    implementation_record,
    installed_names,
    resolve_implementation,
)
from lora_suite.implementations.lora_core_impl import LoraCoreImplementation
from lora_suite.implementations.peft_impl import (
    PeftImplementation,
    adapted_modules,
    count_call,
    load_peft_tensors,
)

__all__ = [
    "OPERATIONS",
    "BUILTINS",
    "BUNDLED",
    "DEFAULT",
    "ENTRY_POINT_GROUP",
    "FEATURES",
    "AdapterSpec",
    "ExpertAdapter",
    "ImplementationError",
    "LoRAImplementation",
    "LoraCoreImplementation",
    "PeftImplementation",
    "adapted_modules",
    "check_contract",
    "count_call",
    "entry_point_names",
    "implementation_record",
    "installed_names",
    "library_version",
    "load_peft_tensors",
    "require_module",
    "resolve_implementation",
]
