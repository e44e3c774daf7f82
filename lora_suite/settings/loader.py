"""The strict YAML loader: tier and model YAML read once, at the edge, into the frozen dataclasses of
``lora_suite.settings.config``, which check their rules as they are built (the same rules as in Python). Every
unknown key, wrong type or impossible value is a ``ConfigError`` that names the key, the value, the file and what was
expected; nothing below this module sees a dict.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from lora_suite.settings.adapter_dtype import AdapterDtype
from lora_suite.settings.config import (
    _FLOAT_TEXT,
    CONFIG_DIR,
    RENAMED,
    RETIRED,
    ConfigError,
    ModelConfig,
    SettingsError,
    TierConfig,
)
from lora_suite.settings.implementation_names import SpecError, parse_spec
from lora_suite.settings.yaml_io import read_yaml


def _build(cls, raw, where: str):
    """Build dataclass ``cls`` from mapping ``raw``; unknown keys and wrong types raise ConfigError."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}: {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        renamed = [f"{k!r} is now {RENAMED[k]!r}" for k in unknown if k in RENAMED and RENAMED[k] in fields]
        renamed += [f"{k!r} was retired: {RETIRED[k]}" for k in unknown if k in RETIRED]
        raise ConfigError(
            f"{where}: unknown key(s) {unknown}; expected some of {sorted(fields)}"
            + (f" ({'; '.join(renamed)})" if renamed else "")
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        kwargs[key] = _coerce(hints[key], value, f"{where}.{key}")
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {missing}")
    try:
        return cls(**kwargs)
    except SettingsError as err:  # the object's rules (settings_rules, tier_rules): their words, placed in the file
        raise ConfigError(f"{where}.{err.key}: {err.detail}") from err


def _coerce(hint, value, where: str):
    if hint is AdapterDtype:  # a dtype's name, or null: the field stores it and its rule judges it
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, where)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
        # YAML 1.1 (PyYAML) reads 1e-3 as a string: it wants a dot in the mantissa (1.0e-3). Accept it.
        return float(value)
    if hint is float:
        raise ConfigError(
            f"{where}: expected a number, got {value!r}" + (" (not a number literal)" if isinstance(value, str) else "")
        )
    if hint in (int, bool, str) and isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {value!r}")


def load_model_config(name_or_path: str | Path, config_dir: Path = CONFIG_DIR) -> ModelConfig:
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):  # a bare name (names may contain dots: tinyllama-1.1b)
        path = config_dir / "models" / f"{name_or_path}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in (config_dir / "models").glob("*.yaml"))
        raise ConfigError(f"model config {name_or_path!r} not found at {path}; known models: {known}")
    return _build(ModelConfig, read_yaml(path), str(path))


def load_tier_config(path: str | Path, config_dir: Path | None = None) -> TierConfig:
    path = Path(path)
    if path.suffix not in (".yaml", ".yml") and not path.exists():
        path = (config_dir or CONFIG_DIR) / f"{path}.yaml"
    config_dir = config_dir or path.resolve().parent
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    raw = dict(raw)
    if "source" in raw:
        raise ConfigError(f"{path}.source: the loader sets it to the file a config came from; remove the key")
    model_ref = raw.get("model")
    if not isinstance(model_ref, str):
        raise ConfigError(f"{path}.model: expected the name of a file in {config_dir / 'models'}, got {model_ref!r}")
    raw["model"] = dataclasses.asdict(load_model_config(model_ref, config_dir))
    cfg = _build(TierConfig, raw, str(path))
    cfg = dataclasses.replace(cfg, source=str(path))
    validate(cfg)
    return cfg


def validate(cfg: TierConfig) -> None:
    """The loader's own rule on a TierConfig: its implementation is a spec (a name or package.module:factory). Every
    other rule ran when the config was built (its objects': ``settings_rules``; across them: ``tier_rules``), and
    holds for a TierConfig made in Python as well; a TierConfig built in Python may carry any implementation's own
    name (the harness sets it), so the spec's pattern is the loader's, not TierConfig's."""
    where = cfg.source or cfg.tier
    try:
        parse_spec(cfg.implementation)
    except SpecError as exc:
        raise ConfigError(f"{where}.implementation: {exc}") from None
