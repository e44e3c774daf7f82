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
  the implementation can (None where it cannot).

Built-ins: ``cupy`` (this project's layer on its CuPy/cuBLAS backend, the default), ``torch`` (the same layer
on the torch reference backend) and ``peft`` (PEFT's LoRA layers). Others come from the entry-point group
``lora_suite.implementations`` (name -> a factory returning a ``LoRAImplementation``) or from a spec
``package.module:factory`` (``--lora-impl``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

ENTRY_POINT_GROUP = "lora_suite.implementations"
DEFAULT = "cupy"

# What an implementation may declare it cannot do (key -> what it means).
FEATURES = {
    "nf4_base": "a 4-bit NF4 base weight under the adapters (QLoRA)",
    "op_call_count": "a count of LoRA op calls, to prove the path under test served them",
    "lora_core_ops": "lora_core's own op and kernels, tested below the model level",
    "cuda_graph_capture": "training steps captured in a CUDA graph (train.cuda_graph)",
    "fp32_adapters_on_16bit_base": "fp32 adapters over a 16-bit base (PEFT's default mixed precision)",
    "rslora": "rank-stabilised scaling s = alpha / sqrt(r)",
    "bf16_base": "a 16-bit base weight (lora.quantize: null)",
}


class ImplementationError(ValueError):
    """An implementation that cannot be found, built, or that breaks the contract."""


@dataclass(frozen=True)
class AdapterSpec:
    targets: tuple[str, ...]  # projection names or ("all-linear",)
    r: int
    alpha: float
    use_rslora: bool = False
    adapter_dtype: torch.dtype | None = torch.float32  # None: the base weight's dtype
    quantize: str | None = None  # None (16-bit base) or "nf4"


class LoRAImplementation:
    """Base class of the contract above. Subclasses set ``name``, ``expected_path`` and implement the methods."""

    name: str = ""
    expected_path: str = ""  # what served_by() returns when every adapted layer ran the path under test
    not_applicable: dict[str, str] = {}  # feature (FEATURES) -> why this implementation cannot do it
    # True: inject() may be given each decoder layer as the model is built (a quantised base then never exists
    # in 16 bits as a whole); False: it is given the whole model once built.
    inject_per_layer: bool = False

    def describe(self) -> str:
        return self.name

    def inject(self, model: nn.Module, spec: AdapterSpec) -> list[str]:
        raise NotImplementedError

    def adapter_parameters(self, model: nn.Module) -> dict[str, nn.Parameter]:
        raise NotImplementedError

    def save_adapter(self, model: nn.Module, path: str | Path) -> Path:
        raise NotImplementedError

    def load_adapter(self, model: nn.Module, path: str | Path) -> None:
        raise NotImplementedError

    def served_by(self, model: nn.Module) -> str:
        raise NotImplementedError

    def op_calls(self) -> int | None:
        return None

    def served_by_adapted_layers(self, model: nn.Module, wrong_layer, inactive) -> str:
        """A ``served_by`` for implementations whose layers are counted by a forward hook (``count_call``):
        ``expected_path`` when every adapted layer is the right kind (``wrong_layer(m)`` is None), active
        (``inactive(m)`` is None) and has run a forward; else what each offending layer is, joined."""
        kinds = set()
        for path in adapted_modules(self.adapter_parameters(model)):
            m = model.get_submodule(path)
            if (wrong := wrong_layer(m)) is not None:
                kinds.add(wrong)
            elif (why := inactive(m)) is not None:
                kinds.add(f"{self.name}, {why}")
            elif not getattr(m, "_lora_suite_calls", 0):
                kinds.add(f"{self.name} layers that never ran")
            else:
                kinds.add(self.expected_path)
        return ",".join(sorted(kinds))

    def quantize_base(self, model: nn.Module) -> bool:
        """Put this implementation's own 4-bit storage into ``model``'s linears (all but the LM head), as its
        ``inject`` does for ``quantize="nf4"``, and return True; False (nothing done) where its NF4 base, if any,
        is lora_core's. Comparison runs (the torch reference, the control) are built on the same quantised
        weights this way (``prepare(..., base_from=)``), so they judge the LoRA layer and not two quantisers."""
        return False

    def reason_not_applicable(self, feature: str) -> str | None:
        if feature not in FEATURES:
            raise ValueError(f"feature {feature!r} is not one of {sorted(FEATURES)}")
        return self.not_applicable.get(feature)


class LoraCoreImplementation(LoRAImplementation):
    """This project's ``lora_core.LoRALinear`` on one backend (``cupy``: the system under test; ``torch``)."""

    inject_per_layer = True

    def __init__(self, backend: str):
        self.name = self.expected_path = backend
        self.not_applicable = {}

    def describe(self) -> str:
        which = "CuPy RawKernels + cuBLAS" if self.name == "cupy" else "torch reference ops"
        return f"{self.name}: lora_core.LoRALinear on the {self.name} backend ({which})"

    def inject(self, model, spec):
        from lora_core.inject import inject_lora

        return inject_lora(
            model,
            spec.targets,
            spec.r,
            spec.alpha,
            backend=self.name,
            use_rslora=spec.use_rslora,
            adapter_dtype=spec.adapter_dtype,
            quantize=spec.quantize,
        )

    def adapter_parameters(self, model):
        from lora_core.inject import adapter_parameters

        return adapter_parameters(model)

    def save_adapter(self, model, path):
        from lora_core.adapters import save_peft_adapter

        return save_peft_adapter(model, path)

    def load_adapter(self, model, path):
        from lora_core.adapters import load_peft_adapter

        load_peft_adapter(model, path)

    def served_by(self, model):
        from lora_core.inject import lora_modules

        return ",".join(sorted({str(m.last_backend) for m in lora_modules(model).values()}))

    def op_calls(self):
        import lora_core

        return lora_core.backend_call_counts()[self.name]


def adapted_modules(adapters: dict[str, nn.Parameter]) -> list[str]:
    """The module paths holding the adapters, in the adapters' order (``<path>.lora_A`` -> ``<path>``)."""
    return list(dict.fromkeys(name.rsplit(".", 1)[0] for name in adapters))


_PEFT_PARAM = re.compile(r"^(?P<path>.+)\.(?P<which>lora_[AB])\.default\.weight$")


class PeftImplementation(LoRAImplementation):
    """PEFT's LoRA layers, put into the model with ``peft.inject_adapter_in_model`` (adapter name ``default``).

    The model stays the Hugging Face model (no ``PeftModel`` wrapper), so the trainer and the checks treat it
    like any other. Dropout 0 and PEFT's default initialisation; adapters cast to the spec's dtype.
    """

    name = expected_path = "peft"
    not_applicable = {
        "nf4_base": "PEFT builds a 4-bit base only through bitsandbytes (not on the lent GPU machine, and not "
        "wired here); lora_core's NF4 storage is not a layer PEFT can wrap",
        "op_call_count": "PEFT's layers keep no call counter; served_by() checks the layer types instead",
        "lora_core_ops": "these tests call lora_core's cupy op and kernels directly, which PEFT does not use",
    }

    def describe(self) -> str:
        import peft

        return f"peft: PEFT {peft.__version__} LoRA layers (peft.tuners.lora), eager torch ops"

    def inject(self, model, spec):
        import peft

        if spec.quantize is not None:
            raise ImplementationError(
                f"peft: quantize={spec.quantize!r} is not supported: {self.not_applicable['nf4_base']}"
            )
        targets = "all-linear" if tuple(spec.targets) == ("all-linear",) else list(spec.targets)
        config = peft.LoraConfig(
            r=spec.r,
            lora_alpha=spec.alpha,
            target_modules=targets,
            lora_dropout=0.0,
            use_rslora=spec.use_rslora,
            bias="none",
        )
        for p in model.parameters():
            p.requires_grad_(False)
        peft.inject_adapter_in_model(config, model)
        model._lora_suite_peft_config = config  # for save_adapter
        adapters = self.adapter_parameters(model)
        if not adapters:
            raise ImplementationError(f"peft: targets {list(spec.targets)} adapted no layer of {type(model).__name__}")
        for path in adapted_modules(adapters):  # served_by() evidence: each layer's forward calls
            layer = model.get_submodule(path)
            layer._lora_suite_calls = 0
            layer.register_forward_hook(count_call)
        with torch.no_grad():
            for p in adapters.values():
                if spec.adapter_dtype is not None and p.dtype != spec.adapter_dtype:
                    p.data = p.data.to(spec.adapter_dtype)
                p.requires_grad_(True)
        return adapted_modules(adapters)

    def adapter_parameters(self, model):
        out = {}
        for name, p in model.named_parameters():
            m = _PEFT_PARAM.match(name)
            if m:
                out[f"{m['path']}.{m['which']}"] = p
        return out

    def save_adapter(self, model, path):
        from safetensors.torch import save_file

        from lora_core.adapters import PREFIX, WEIGHTS_FILE

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = getattr(model, "_lora_suite_peft_config", None)
        if config is None:
            raise ImplementationError("peft: the model was not injected by this implementation (no LoRA config)")
        config.save_pretrained(str(path))
        tensors = {
            f"{PREFIX}{name}.weight": p.detach().to("cpu").contiguous()
            for name, p in self.adapter_parameters(model).items()
        }
        save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
        return path

    def load_adapter(self, model, path):
        load_peft_tensors(self.name, self.adapter_parameters(model), path)

    def wrong_layer(self, m: nn.Module) -> str | None:
        """Why ``m`` is not the layer this implementation puts in, or None."""
        from peft.tuners.lora import LoraLayer

        return None if isinstance(m, LoraLayer) else f"{type(m).__name__} (not a PEFT LoRA layer)"

    def served_by(self, model):
        """``name`` when every adapted layer is the implementation's PEFT layer (``wrong_layer``), active (not
        merged, not disabled) and has run a forward (counted by a hook put there at injection); else what each
        offending layer is."""

        def inactive(m):
            return f"merged={m.merged} disabled={m.disable_adapters}" if m.merged or m.disable_adapters else None

        return self.served_by_adapted_layers(model, self.wrong_layer, inactive)


def load_peft_tensors(who: str, adapters: dict[str, nn.Parameter], path: str | Path) -> None:
    """Copy a PEFT folder's tensors into ``adapters`` (canonical names), refusing keys that fit no adapter,
    adapters without a key and shapes that differ, each named; the config must parse."""
    from safetensors.torch import load_file

    from lora_core.adapters import CONFIG_FILE, PREFIX, WEIGHTS_FILE

    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise ImplementationError(f"{who}: {path} has no {CONFIG_FILE}: not a PEFT folder")
    try:
        json.loads((path / CONFIG_FILE).read_text())  # a broken config is an error here, not later
    except json.JSONDecodeError as exc:
        raise ImplementationError(f"{who}: {path / CONFIG_FILE} is not valid JSON ({exc})") from None
    tensors = load_file(str(path / WEIGHTS_FILE))
    by_key = {f"{PREFIX}{name}.weight": p for name, p in adapters.items()}
    unknown = sorted(set(tensors) - set(by_key))
    missing = sorted(set(by_key) - set(tensors))
    if unknown or missing:
        raise ImplementationError(
            f"{who}: {path}: keys that fit no adapter {unknown[:5]}, adapters without a key {missing[:5]}"
        )
    with torch.no_grad():
        for key, p in by_key.items():
            if tensors[key].shape != p.shape:
                raise ImplementationError(
                    f"{who}: {key} has shape {tuple(tensors[key].shape)}, the model's adapter {tuple(p.shape)}"
                )
            p.copy_(tensors[key])


def save_peft_tensors(adapters: dict[str, nn.Parameter], config: dict, path: str | Path) -> Path:
    """Write ``adapters`` (canonical names) and ``config`` as a PEFT folder (PEFT's key names)."""
    from safetensors.torch import save_file

    from lora_core.adapters import CONFIG_FILE, PREFIX, WEIGHTS_FILE

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    save_file(
        {f"{PREFIX}{name}.weight": p.detach().to("cpu").contiguous() for name, p in adapters.items()},
        str(path / WEIGHTS_FILE),
        metadata={"format": "pt"},
    )
    return path


def count_call(module, args, output) -> None:
    module._lora_suite_calls += 1


def _builtin(name: str) -> LoRAImplementation | None:
    if name in ("cupy", "torch"):
        return LoraCoreImplementation(name)
    if name == "peft":
        try:
            import peft  # noqa: F401
        except ImportError as exc:
            raise ImplementationError(
                f"--lora-impl peft: peft does not import ({exc}); install lora-gpu-suite[peft]"
            ) from None
        return PeftImplementation()
    return None


BUILTINS = ("cupy", "torch", "peft")
# Peers bundled with the suite (lora_suite/peers): the same specs as pyproject's entry points, so that a source
# checkout on PYTHONPATH (a lent GPU machine runs the suite uninstalled) finds them by name too.
BUNDLED = {
    "loralib": "lora_suite.peers.loralib_impl:LoralibImplementation",
    "torchtune": "lora_suite.peers.torchtune_impl:TorchtuneImplementation",
    "peft-bnb": "lora_suite.peers.peft_bnb_impl:PeftBnbImplementation",
}


def entry_point_names() -> list[str]:
    """Names of the entry points of ``ENTRY_POINT_GROUP`` and of the bundled peers."""
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)} | set(BUNDLED))


def installed_names() -> list[str]:
    """Every implementation that can be built here: the built-ins, then the entry points and bundled peers whose
    library imports (the scorecard's default selection)."""
    names = ["cupy", "torch"] + (["peft"] if importlib.util.find_spec("peft") else [])
    for name in entry_point_names():
        try:
            resolve_implementation(name)
        except ImplementationError:
            continue
        names.append(name)
    return names


def resolve_implementation(spec: str | None) -> LoRAImplementation:
    """The implementation ``spec`` names: a built-in, an entry point of ``ENTRY_POINT_GROUP``, or ``module:factory``."""
    spec = DEFAULT if spec is None else spec
    if not isinstance(spec, str) or not spec.strip():
        raise ImplementationError(
            f"LoRA implementation {spec!r}: expected a name ({', '.join(BUILTINS)}, an entry "
            f"point of {ENTRY_POINT_GROUP!r}) or 'package.module:factory'"
        )
    impl = _builtin(spec)
    if impl is None and ":" in spec:
        module_name, _, attr = spec.partition(":")
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", module_name) or not re.fullmatch(r"[A-Za-z_]\w*", attr):
            raise ImplementationError(
                f"LoRA implementation {spec!r}: expected 'package.module:factory' (a dotted "
                "module path, a colon, a Python name)"
            )
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ImplementationError(
                f"LoRA implementation {spec!r}: cannot load {attr!r} from module "
                f"{module_name!r} ({type(exc).__name__}: {exc})"
            ) from None
        impl = _call_factory(factory, spec)
    elif impl is None:
        eps = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
        if spec not in eps and spec in BUNDLED:
            return check_contract(resolve_implementation(BUNDLED[spec]), spec)
        if spec not in eps:
            raise ImplementationError(
                f"LoRA implementation {spec!r} is not known: built-ins {list(BUILTINS)}, entry points of "
                f"{ENTRY_POINT_GROUP!r} {sorted(eps)}, or give 'package.module:factory'"
            )
        factory = eps[spec].load()
        impl = _call_factory(factory, spec)
    return check_contract(impl, spec)


def require_module(impl: str, module: str):
    """``module`` imported for implementation ``impl``, or an ImplementationError naming the extra to install
    (the bundled peers' libraries are optional extras named after them)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImplementationError(
            f"--lora-impl {impl}: {module} does not import ({exc}); install lora-gpu-suite[{impl}]"
        ) from None


def _call_factory(factory, spec: str):
    """The factory's implementation; a factory that fails to build one is named with its error."""
    if not callable(factory) or isinstance(factory, type) and not issubclass(factory, LoRAImplementation):
        return factory  # check_contract names what it is instead
    try:
        return factory()
    except ImplementationError:
        raise
    except Exception as exc:
        raise ImplementationError(
            f"LoRA implementation {spec!r}: its factory {getattr(factory, '__name__', factory)!r} "
            f"raised {type(exc).__name__}: {exc}"
        ) from exc


def implementation_record(impl: LoRAImplementation, spec: str | None = None) -> dict:
    """What a report says about the implementation under test (``RunReport.implementation``)."""
    return {
        "name": impl.name,
        "spec": spec or impl.name,
        "description": impl.describe(),
        "not_applicable": dict(impl.not_applicable),
    }


def check_contract(impl, spec: str) -> LoRAImplementation:
    """Refuse, at selection time, an object that does not meet the contract (naming what is missing)."""
    if not isinstance(impl, LoRAImplementation):
        raise ImplementationError(
            f"LoRA implementation {spec!r} gave a {type(impl).__name__}, not a "
            "lora_suite.implementations.LoRAImplementation"
        )
    missing = [
        m
        for m in ("inject", "adapter_parameters", "save_adapter", "load_adapter", "served_by")
        if getattr(type(impl), m) is getattr(LoRAImplementation, m)
    ]
    if missing or not impl.name or not impl.expected_path:
        raise ImplementationError(
            f"LoRA implementation {spec!r} ({type(impl).__name__}) does not meet the contract: "
            f"methods not implemented {missing}, name={impl.name!r}, "
            f"expected_path={impl.expected_path!r}"
        )
    unknown = sorted(set(impl.not_applicable) - set(FEATURES))
    if unknown:
        raise ImplementationError(
            f"LoRA implementation {spec!r} declares unknown features {unknown}; known: {sorted(FEATURES)}"
        )
    return impl
