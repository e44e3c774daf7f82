"""The strict YAML loader: tier and model YAML read once, at the edge, into the frozen dataclasses of
``lora_suite.settings.config``, and validated. Every unknown key, wrong type or impossible value is a ``ConfigError``
that names the key, the value, the file and what was expected; nothing below this module sees a dict.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from lora_core.targets import TARGET_NAMES  # the system under test owns the target names
from lora_suite.settings.config import (
    _FLOAT_TEXT,
    CONFIG_DIR,
    RENAMED,
    RETIRED,
    ConfigError,
    Criteria,
    DataSettings,
    ModelConfig,
    SettingsError,
    TierConfig,
    TrainSettings,
    target_shapes,
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
    except SettingsError as err:  # the object's own rules (settings_rules): their words, placed in the file
        raise ConfigError(f"{where}.{err.key}: {err.detail}") from err


def _coerce(hint, value, where: str):
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
    """The rules that span a TierConfig's objects, at load time (each object checked its own fields when it was
    built: lora_suite.settings.settings_rules); the message names key, value and range."""
    where = cfg.source or cfg.tier
    # The YAML's implementation is a spec (a name or package.module:factory); a TierConfig built in Python may carry
    # any implementation's own name (the harness sets it), so the spec's pattern is the loader's, not TierConfig's.
    try:
        parse_spec(cfg.implementation)
    except SpecError as exc:
        raise ConfigError(f"{where}.implementation: {exc}") from None
    bad = [t for t in cfg.lora.targets if t not in TARGET_NAMES + ("all-linear",)]
    if bad:
        raise ConfigError(f"{where}.lora.targets: {bad} not among {TARGET_NAMES} or 'all-linear'")
    for key, value, ok, expected in _spanning_rules(cfg):
        if not ok:
            raise ConfigError(f"{where}.{key}: {value!r} is out of range; expected {expected}")


def _spanning_rules(cfg: TierConfig) -> list[tuple[str, object, bool, str]]:
    """(key, value, ok, expected) of each rule that involves two objects: the rank against the model's projection
    shapes, seq_len against its positions, the criteria's windows against train.steps, the accumulation check's
    micro-batches against data.batch_size."""
    a, t, c, d, r = cfg.model.architecture, cfg.train, cfg.criteria, cfg.data, cfg.lora.r
    timed = _any_timed_criterion(c)
    after_fit = t.steps - c.fit_after_step
    low, name = min((min(io), name) for name, io in target_shapes(a, cfg.lora.targets).items())
    return [
        ("lora.r", r, r <= low, f"1 <= r <= {low} (min(in, out) of {name}: a larger rank is not low-rank)"),
        (
            "data.seq_len",
            d.seq_len,
            d.seq_len <= a.max_position_embeddings,
            f"2 <= seq_len <= max_position_embeddings={a.max_position_embeddings}",
        ),
    ] + _criteria_rules(c, t, d, timed, after_fit)


def _any_timed_criterion(c: Criteria) -> bool:
    """Whether a criterion that judges the steps after the warm-up (fit_after_step) is set: leaks, stalls, drift."""
    return any(
        v is not None
        for v in (
            c.leak_slope_max_mib_per_step,
            c.stall_fraction_max,
            c.device_time_drift_max,
            c.aged_vs_fresh_slowdown_max,
            c.host_leak_slope_max_mib_per_step,
        )
    )


def _criteria_rules(
    c: Criteria, t: TrainSettings, d: DataSettings, timed: bool, after_fit: int
) -> list[tuple[str, object, bool, str]]:
    """The spanning rules of the criteria: their windows against train.steps (``after_fit`` of them after
    fit_after_step), the accumulation check's micro-batches against data.batch_size."""
    return [
        (
            "criteria.loss_window",
            c.loss_window,
            c.loss_drop_min is None or 2 * c.loss_window <= t.steps,
            f">= 1, and two windows must fit in steps={t.steps} when loss_drop_min is set",
        ),
        (
            "criteria.fit_after_step",
            c.fit_after_step,
            c.fit_after_step < t.steps or not timed,
            f"0 <= x < steps={t.steps}",
        ),
        (
            "criteria.smooth_window",
            c.smooth_window,
            c.smooth_slack is None or 2 * c.smooth_window <= after_fit,
            f">= 1, and two windows must fit in the {after_fit} steps after fit_after_step",
        ),
        (
            "criteria.device_window",
            c.device_window,
            c.device_time_drift_max is None or 2 * c.device_window <= after_fit,
            f">= 2, and two windows must fit in the {after_fit} steps after fit_after_step",
        ),
        (
            "criteria.bf16_comparison_steps",
            c.bf16_comparison_steps,
            c.bf16_comparison_steps is None or c.bf16_comparison_steps <= t.steps,
            f"null or 1 <= x <= steps={t.steps}",
        ),
        (
            "criteria.grad_accum_k",
            c.grad_accum_k,
            c.grad_accum_k is None or d.batch_size % c.grad_accum_k == 0,
            f"null or >= 2 dividing batch_size={d.batch_size}",
        ),
    ]
