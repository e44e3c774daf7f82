"""How the implementation under test is chosen: the built-ins, the bundled peers, the entry-point group and
``package.module:factory`` specs; the contract check a resolved implementation must pass."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util

from lora_suite.implementations.contract import (
    DEFAULT,
    ENTRY_POINT_GROUP,
    FEATURES,
    ImplementationError,
    LoRAImplementation,
    require_module,
)
from lora_suite.implementations.lora_core_impl import FusedLoraCoreImplementation, LoraCoreImplementation
from lora_suite.implementations.peft_impl import PeftImplementation
from lora_suite.settings.implementation_names import BUILTINS, BUNDLED, SpecError, entry_point_names, parse_spec


def _peft() -> LoRAImplementation:
    require_module("peft", "peft")
    return PeftImplementation()


# The built-ins' factories, one per name of BUILTINS (a test holds the two to the same names)
BUILTIN_FACTORIES = {
    "cupy": lambda: LoraCoreImplementation("cupy"),
    "cupy-fused": FusedLoraCoreImplementation,
    "torch": lambda: LoraCoreImplementation("torch"),
    "peft": _peft,
}


def installed_names() -> list[str]:
    """Every implementation that can be built here: the built-ins, then the entry points and bundled peers whose
    library imports (the scorecard's default selection)."""
    names = []
    for name in (*BUILTINS, *entry_point_names()):
        try:
            resolve_implementation(name)
        except ImplementationError:
            continue
        names.append(name)
    return names


def resolve_implementation(spec: str | None) -> LoRAImplementation:
    """The implementation ``spec`` names: a built-in, an entry point of ``ENTRY_POINT_GROUP``, or ``module:factory``."""
    spec = DEFAULT if spec is None else spec
    try:
        parsed = parse_spec(spec)
    except SpecError as exc:
        raise ImplementationError(str(exc)) from None
    impl = BUILTIN_FACTORIES[spec]() if spec in BUILTIN_FACTORIES else None
    if impl is None and parsed.is_module:
        module_name, attr = str(parsed.module), str(parsed.factory)
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except Exception as exc:  # the user's module: whatever it raises at import is named in one line, with where
            raise ImplementationError(
                f"LoRA implementation {spec!r}: cannot load {attr!r} from module "
                f"{module_name!r} ({type(exc).__name__}: {exc}{raised_at(exc)})"
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
        try:
            factory = eps[spec].load()
        except Exception as exc:
            raise ImplementationError(
                f"LoRA implementation {spec!r}: its entry point {eps[spec].value!r} does not load "
                f"({type(exc).__name__}: {exc}{raised_at(exc)})"
            ) from None
        impl = _call_factory(factory, spec)
    return check_contract(impl, spec)


def raised_at(exc: BaseException) -> str:
    """``, raised at FILE:LINE``: the innermost frame of the exception's traceback (the user's line), or ""."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return "" if tb is None else f", raised at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"


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
