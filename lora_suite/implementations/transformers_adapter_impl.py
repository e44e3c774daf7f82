"""``transformers-adapter``: LoRA through transformers' own PEFT integration (``PeftAdapterMixin``, on every
``PreTrainedModel``), the path of HF Trainer users who call ``model.add_adapter`` instead of ``peft.get_peft_model``.

What runs: ``model.add_adapter(peft.LoraConfig(...))`` (adapter ``default``, made active) and
``model.enable_adapters()``, which put PEFT's LoRA layers in through ``peft.inject_adapter_in_model``; the model keeps
its class (no ``PeftModel`` wrapper). The adapters are saved from ``model.get_adapter_state_dict()`` (keys
``<module path>.lora_A.weight``, without PEFT's ``base_model.model.`` prefix, which the folder's keys get, as
transformers' ``save_pretrained`` writes them), and loaded by ``model.load_adapter(folder, "default",
hotswap=True, is_trainable=True)``: into the adapter ``add_adapter`` made, as the Trainer resumes one. That loader
puts new ``Parameter`` objects in place of the adapters (their values, dtype and ``requires_grad`` kept): read the
adapters again after a load (``adapter_parameters``), as the suite's resume does.

transformers' loader only logs a key that fits no adapter (its load report: UNEXPECTED) and, into an existing
adapter, keeps the model's scale whatever the folder's config says (a folder of 4x the alpha loads without a word,
transformers 5.17: issue 28's defect), so a folder is first checked as every PEFT folder the suite reads
(target_modules, then ``load_peft_tensors``: its config, r, lora_alpha and use_rslora the model's, every key and
shape): a folder that does not fit is refused before anything is loaded, and what transformers loaded is then
compared bitwise with the folder.

A module that is not a transformers model (the suite's layer probes, one decoder block) is given the mixin's
functions, bound to it (``mixin``: the same code); transformers' loader needs a ``PreTrainedModel``
(``_load_pretrained_model``), so such a module's folder is copied in by ``load_peft_tensors``.

transformers refuses a peft older than its ``MIN_PEFT_VERSION`` in every mixin method: where the installed pair is
refused, ``preload`` and ``inject`` say so, naming both versions (``integration_refusal``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from lora_suite.implementations import peft_names
from lora_suite.implementations.contract import (
    ImplementationError,
    LoRAImplementation,
    library_version,
    require_module,
)
from lora_suite.implementations.peft_bnb_impl import BnbBase
from lora_suite.implementations.peft_impl import PeftImplementation, load_peft_tensors

if TYPE_CHECKING:
    from torch import nn

ADAPTER = "default"  # the name add_adapter gives when none is passed


def integration_refusal() -> str | None:
    """Why transformers' PEFT integration refuses the installed peft (its own gate, ``check_peft_version`` against
    ``transformers.integrations.peft.MIN_PEFT_VERSION``, run first by every mixin method), or None."""
    import transformers
    import transformers.integrations.peft as integration
    from transformers.utils.peft_utils import check_peft_version

    try:
        check_peft_version(min_version=integration.MIN_PEFT_VERSION)
    except ValueError as exc:
        return (
            f"transformers {transformers.__version__}'s PEFT integration needs peft >= {integration.MIN_PEFT_VERSION}, "
            f"peft {library_version('peft')} is installed ({exc})"
        )
    return None


def _leaves(targets) -> set[str]:
    """The projection names of target_modules given as names or as module paths (PEFT matches a name at a path's
    end)."""
    return {str(t).rsplit(".", 1)[-1] for t in targets}


# What a module that is not a transformers model is given (``mixin``)
MIXIN_METHODS = (
    "add_adapter",
    "set_adapter",
    "enable_adapters",
    "disable_adapters",
    "active_adapters",
    "get_adapter_state_dict",
    "delete_adapter",
)


def mixin(model: nn.Module, method: str):
    """``model``'s own ``method`` of transformers' ``PeftAdapterMixin``. A module that is not a transformers model is
    first given the mixin's state (``_hf_peft_config_loaded``, as ``PreTrainedModel.__init__`` sets it) and its
    functions of ``MIXIN_METHODS`` bound to it, the same code (they call each other on ``self``)."""
    import types

    from transformers.integrations import PeftAdapterMixin

    if not isinstance(model, PeftAdapterMixin) and not hasattr(model, "_hf_peft_config_loaded"):
        model.__dict__["_hf_peft_config_loaded"] = False  # a plain attribute, as nn.Module keeps a bool
        for name in MIXIN_METHODS:
            setattr(model, name, types.MethodType(getattr(PeftAdapterMixin, name), model))
    return getattr(model, method)


class TransformersAdapterImplementation(BnbBase, PeftImplementation):
    """PEFT's LoRA layers put in by transformers' ``add_adapter`` (module docstring). Dropout 0, PEFT's default
    initialisation, the adapters cast to the spec's dtype; an NF4 base is bitsandbytes', as for peft-bnb (``BnbBase``:
    the model marked ``is_loaded_in_4bit`` as transformers marks a model it loaded in 4 bits)."""

    name = expected_path = "transformers-adapter"
    not_applicable = dict(PeftImplementation.not_applicable)
    operation_reasons = {
        "combine": "transformers' PeftAdapterMixin offers no add_weighted_adapter (PEFT's PeftModel and LoraModel do)"
    }
    combine_adapters = LoRAImplementation.combine_adapters  # transformers offers no such call (operation_reasons)

    def __init__(self):
        require_module(self.name, "peft", "transformers", when="found")
        self._declare_base()

    def describe(self) -> str:
        return (
            f"transformers-adapter: transformers {library_version('transformers')}'s PeftAdapterMixin.add_adapter over "
            f"PEFT {library_version('peft')} LoRA layers (peft.inject_adapter_in_model), eager torch ops"
        )

    def preload(self) -> None:
        self._refuse_incompatible()

    def _refuse_incompatible(self) -> None:
        require_module(self.name, "peft", "transformers.integrations.peft", when="use")
        if (why := integration_refusal()) is not None:
            raise ImplementationError(f"{self.name}: {why}; install a peft that transformers accepts")

    def inject(self, model, spec):
        import peft

        self._refuse_incompatible()
        spec = self._bnb_spec(model, spec)
        config = peft.LoraConfig(**self.lora_config_args(spec))
        mixin(model, "add_adapter")(config)  # freezes all but the adapters, makes "default" the active adapter
        mixin(model, "enable_adapters")()
        return self.count_and_train(model, spec)

    def add_named_adapter(self, model, name, spec):
        """transformers' own ``add_adapter(config, adapter_name=name)`` with the first adapter's config (in its
        adapters' dtype), then the adapter that was active set again (``set_adapter``)."""
        active = mixin(model, "active_adapters")()
        dtype = next(iter(self.adapter_parameters(model).values())).dtype
        mixin(model, "add_adapter")(self._config(model), adapter_name=name)
        mixin(model, "set_adapter")(active)
        self._cast_adapter(model, name, dtype)

    def set_active_adapter(self, model, name):
        """transformers' own ``set_adapter(name)``."""
        mixin(model, "set_adapter")(name)

    def delete_named_adapter(self, model, name):
        """transformers' own ``delete_adapter(name)``."""
        mixin(model, "delete_adapter")(name)

    def _config(self, model):
        config = getattr(model, "peft_config", {}).get(ADAPTER) if getattr(model, "_hf_peft_config_loaded", 0) else None
        if config is None:
            raise ImplementationError(
                f"{self.name}: {type(model).__name__} has no adapter {ADAPTER!r} of transformers' PEFT integration "
                "(not injected by this implementation)"
            )
        return config

    def save_adapter(self, model, path):
        """A PEFT folder: the config ``add_adapter`` was given, and ``get_adapter_state_dict()``'s tensors under PEFT's
        keys (``base_model.model.<key>``, as transformers' ``save_pretrained`` writes them), every adapter's."""
        from safetensors.torch import save_file

        from lora_core.adapters import PREFIX, WEIGHTS_FILE

        config = self._config(model)
        state = mixin(model, "get_adapter_state_dict")(ADAPTER)
        # an adapted embedding or LM head brings its base weight (PEFT's save_embedding_layers): the folder holds the
        # adapters only, as PEFT's save_pretrained(save_embedding_layers=False) writes it
        state = {k: t for k, t in state.items() if not k.endswith(".base_layer.weight")}
        want = {peft_names.folder_key(name, "") for name in self._held(model)}
        if set(state) != want:
            raise ImplementationError(
                f"{self.name}: get_adapter_state_dict() gave keys {sorted(set(state) - want)[:5]} beside the "
                f"adapters, and lacks {sorted(want - set(state))[:5]}"
            )
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(str(path))
        tensors = {f"{PREFIX}{key}": t.detach().to("cpu").contiguous() for key, t in state.items()}
        save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
        return path

    def load_adapter(self, model, path):
        """``path`` checked against the model's adapters (``_checked``), then loaded by transformers' own
        ``load_adapter`` into adapter ``default`` (a transformers model) or copied in (any other module)."""
        from transformers import PreTrainedModel

        want = self._checked(model, Path(path))
        if not isinstance(model, PreTrainedModel):
            load_peft_tensors(self.name, self._held(model), path)
            return
        info = model.load_adapter(str(path), adapter_name=ADAPTER, hotswap=True, is_trainable=True)
        left = {k: sorted(map(str, getattr(info, k, ())))[:5] for k in ("missing_keys", "unexpected_keys")}
        left["mismatched_keys"] = sorted(str(m) for m in getattr(info, "mismatched_keys", ()))[:5]
        got = self._held(model)
        differ = [n for n, t in want.items() if not got[n].requires_grad or not got[n].detach().cpu().equal(t)]
        if any(left.values()) or differ:
            raise ImplementationError(
                f"{self.name}: transformers' load_adapter of {path} left {left} and adapters not the folder's "
                f"(or frozen) {differ[:5]}"
            )

    def _checked(self, model, path: Path) -> dict:
        """The folder's tensors (canonical name -> tensor in the adapter's dtype, on the CPU), read into copies: its
        target_modules the model's where both are lists (compared by projection name), then ``load_peft_tensors``'
        checks (its config, r, lora_alpha, use_rslora, keys and shapes the model's); else an ImplementationError
        naming the value, before anything is loaded."""
        import torch

        config = self._config(model)
        try:  # a config that is missing or not a JSON object: load_peft_tensors names what is wrong
            theirs = json.loads((path / "adapter_config.json").read_text()).get("target_modules")
        except (OSError, ValueError, AttributeError):
            theirs = None
        ours = config.target_modules  # names as given, or the module paths "all-linear" was expanded to
        if isinstance(theirs, list) and not isinstance(ours, str) and _leaves(theirs) != _leaves(ours):
            raise ImplementationError(
                f"{self.name}: {path / 'adapter_config.json'} has target_modules={sorted(theirs)}, the model's "
                f"adapters target {sorted(_leaves(ours))}"
            )
        expect = {"r": config.r, "lora_alpha": config.lora_alpha, "use_rslora": bool(config.use_rslora)}
        expect.update(rank_pattern=dict(config.rank_pattern or {}), alpha_pattern=dict(config.alpha_pattern or {}))
        expect.update(use_dora=bool(config.use_dora), lora_bias=bool(config.lora_bias))
        copies = {
            n: torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=False)
            for n, p in self._held(model).items()
        }
        load_peft_tensors(self.name, copies, path, expect)
        return {n: p.data for n, p in copies.items()}

    def served_by(self, model):
        """``name`` when transformers' integration adapted the model (``_hf_peft_config_loaded``, adapter ``default``
        active) and every adapted layer is PEFT's, active and has run (``PeftImplementation.served_by``); else what
        is wrong."""
        if not getattr(model, "_hf_peft_config_loaded", False):
            return (
                f"{type(model).__name__} not adapted by transformers' PEFT integration (_hf_peft_config_loaded unset)"
            )
        active = mixin(model, "active_adapters")()
        if list(active) != [ADAPTER]:
            return f"transformers' PEFT integration with active adapters {list(active)}, not [{ADAPTER!r}]"
        return super().served_by(model)
