"""The strict YAML loader: tier and model YAML read once, at the edge, into the frozen dataclasses of
``lora_suite.core.config``, and validated. Every unknown key, wrong type or impossible value is a ``ConfigError``
that names the key, the value, the file and what was expected; nothing below this module sees a dict.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from pathlib import Path

from lora_core.targets import TARGET_NAMES  # the system under test owns the target names
from lora_suite.core.config import (
    _FLOAT_TEXT,
    CONFIG_DIR,
    IMPLEMENTATION_SPEC,
    RENAMED,
    RETIRED,
    WEIGHTS_MODES,
    ConfigError,
    LlamaArchitecture,
    ModelConfig,
    SuiteEntry,
    TierConfig,
    target_shapes,
)
from lora_suite.core.yaml_io import read_yaml


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
    return cls(**kwargs)


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
    model = _build(ModelConfig, read_yaml(path), str(path))
    validate_model(model, str(path))
    return model


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


def _architecture_rules(a: LlamaArchitecture) -> list[tuple[str, object, bool, str]]:
    """(key, value, ok, expected) for every architecture knob."""
    rules = [
        (f"architecture.{n}", getattr(a, n), getattr(a, n) >= 1, ">= 1")
        for n in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "max_position_embeddings",
        )
    ]
    if all(ok for _, _, ok, _ in rules):
        rules += [
            (
                "architecture.hidden_size",
                a.hidden_size,
                a.hidden_size % a.num_attention_heads == 0,
                f"a multiple of num_attention_heads={a.num_attention_heads}",
            ),
            (
                "architecture.num_attention_heads",
                a.num_attention_heads,
                a.num_attention_heads % a.num_key_value_heads == 0,
                f"a multiple of num_key_value_heads={a.num_key_value_heads}",
            ),
        ]
    rules += [
        ("architecture.rope_theta", a.rope_theta, math.isfinite(a.rope_theta) and a.rope_theta > 0, "finite, > 0"),
        (
            "architecture.rms_norm_eps",
            a.rms_norm_eps,
            math.isfinite(a.rms_norm_eps) and a.rms_norm_eps > 0,
            "finite, > 0",
        ),
    ]
    return rules


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def validate_model(model: ModelConfig, where: str) -> None:
    for key, value, ok, expected in _architecture_rules(model.architecture):
        if not ok:
            raise ConfigError(f"{where}.{key}: {value!r} is out of range; expected {expected}")


def validate(cfg: TierConfig) -> None:
    """Every knob against its allowed range, at load time: the message names key, value and range."""
    where = cfg.source or cfg.tier
    enum_rules = [
        ("weights", cfg.weights, WEIGHTS_MODES),
        ("dtype", cfg.dtype, ("bfloat16", "float16", "float32")),
        ("lora.quantize", cfg.lora.quantize, (None, "nf4")),
        ("lora.adapter_dtype", cfg.lora.adapter_dtype, ("float32", "bfloat16", "float16")),
        ("data.source", cfg.data.source, ("embedded", "jsonl")),
        ("train.schedule", cfg.train.schedule, ("cosine", "linear", "constant")),
    ]
    for key, value, allowed in enum_rules:
        if value not in allowed:
            raise ConfigError(f"{where}.{key}: {value!r} is not one of {list(allowed)}")
    if not isinstance(cfg.implementation, str) or not IMPLEMENTATION_SPEC.fullmatch(cfg.implementation):
        raise ConfigError(
            f"{where}.implementation: {cfg.implementation!r} is not a LoRA implementation name "
            "(cupy, torch, peft, an entry point name) or 'package.module:factory'"
        )
    bad = [t for t in cfg.lora.targets if t not in TARGET_NAMES + ("all-linear",)]
    if bad or not cfg.lora.targets:
        raise ConfigError(
            f"{where}.lora.targets: {list(bad or cfg.lora.targets)} not among {TARGET_NAMES} or 'all-linear'"
        )
    if cfg.data.source == "jsonl" and not cfg.data.path:
        raise ConfigError(f"{where}.data.path: None; source 'jsonl' needs the path of an Alpaca-format JSONL file")
    validate_model(cfg.model, f"{where}.model({cfg.model.name})")
    if cfg.suite is not None:
        validate_suite_entry(cfg.suite, f"{where}.suite")
    a, t, c, d = cfg.model.architecture, cfg.train, cfg.criteria, cfg.data
    timed = any(
        v is not None
        for v in (
            c.leak_slope_max_mib_per_step,
            c.stall_fraction_max,
            c.device_time_drift_max,
            c.aged_vs_fresh_slowdown_max,
            c.host_leak_slope_max_mib_per_step,
        )
    )
    smallest = min((min(io), name) for name, io in target_shapes(a, cfg.lora.targets).items())
    rules = [
        (
            "lora.r",
            cfg.lora.r,
            1 <= cfg.lora.r <= smallest[0],
            f"1 <= r <= {smallest[0]} (min(in, out) of {smallest[1]}: a larger rank is not low-rank)",
        ),
        (
            "lora.alpha",
            cfg.lora.alpha,
            _finite(cfg.lora.alpha) and cfg.lora.alpha > 0,
            "finite, > 0 (alpha 0 makes the adapter a no-op: nothing would be tested)",
        ),
        ("data.batch_size", d.batch_size, d.batch_size >= 1, ">= 1"),
        (
            "data.seq_len",
            d.seq_len,
            2 <= d.seq_len <= a.max_position_embeddings,
            f"2 <= seq_len <= max_position_embeddings={a.max_position_embeddings}",
        ),
        ("data.pool", d.pool, d.pool >= 0, ">= 0 (0: fresh windows every step)"),
        ("data.seed", d.seed, d.seed >= 0, ">= 0"),
        ("train.steps", t.steps, t.steps >= 1, ">= 1"),
        # AdamW moves each adapter value by about lr a step: above 1 no run learns (issue 28: lr 1e30 "trained"
        # to the end with a gradient norm of 0 and no complaint)
        ("train.lr", t.lr, _finite(t.lr) and 0 < t.lr <= 1.0, "finite, > 0 and <= 1"),
        ("train.warmup_steps", t.warmup_steps, 0 <= t.warmup_steps < t.steps, f"0 <= warmup_steps < steps={t.steps}"),
        ("train.min_lr_ratio", t.min_lr_ratio, _finite(t.min_lr_ratio) and 0 <= t.min_lr_ratio <= 1, "0 <= x <= 1"),
        ("train.grad_accum", t.grad_accum, t.grad_accum >= 1, ">= 1"),
        ("train.weight_decay", t.weight_decay, _finite(t.weight_decay) and t.weight_decay >= 0, "finite, >= 0"),
        (
            "train.max_grad_norm",
            t.max_grad_norm,
            t.max_grad_norm is None or (_finite(t.max_grad_norm) and t.max_grad_norm > 0),
            "null (no clipping) or finite, > 0 (a negative norm flips the gradient, 0 zeroes it)",
        ),
        ("train.log_every", t.log_every, t.log_every >= 1, ">= 1"),
        ("train.seed", t.seed, t.seed >= 0, ">= 0"),
        ("train.host_probe_ops", t.host_probe_ops, 0 <= t.host_probe_ops <= 100_000, "0 (off) <= x <= 100000"),
        (
            "train.graph_warmup_steps",
            t.graph_warmup_steps,
            t.graph_warmup_steps >= 1 and (not t.cuda_graph or t.graph_warmup_steps < t.steps),
            f">= 1, and < steps={t.steps} with cuda_graph (CUDA graphs need eager warm-up steps before the capture)",
        ),
        (
            "criteria.loss_window",
            c.loss_window,
            c.loss_window >= 1 and (c.loss_drop_min is None or 2 * c.loss_window <= t.steps),
            f">= 1, and two windows must fit in steps={t.steps} when loss_drop_min is set",
        ),
        (
            "criteria.fit_after_step",
            c.fit_after_step,
            0 <= c.fit_after_step and (c.fit_after_step < t.steps or not timed),
            f"0 <= x < steps={t.steps}",
        ),
        (
            "criteria.smooth_window",
            c.smooth_window,
            c.smooth_window >= 1 and (c.smooth_slack is None or 2 * c.smooth_window <= t.steps - c.fit_after_step),
            f">= 1, and two windows must fit in the {t.steps - c.fit_after_step} steps after fit_after_step",
        ),
        (
            "criteria.control_perturbation",
            c.control_perturbation,
            _finite(c.control_perturbation) and 0 < c.control_perturbation < 1,
            "0 < x < 1",
        ),
        ("criteria.stall_factor", c.stall_factor, _finite(c.stall_factor) and c.stall_factor > 1, "finite, > 1"),
        ("criteria.drift_noise_z", c.drift_noise_z, _finite(c.drift_noise_z) and c.drift_noise_z >= 0, "finite, >= 0"),
        (
            "criteria.device_window",
            c.device_window,
            c.device_window >= 2
            and (c.device_time_drift_max is None or 2 * c.device_window <= t.steps - c.fit_after_step),
            f">= 2, and two windows must fit in the {t.steps - c.fit_after_step} steps after fit_after_step",
        ),
        ("criteria.device_clip", c.device_clip, _finite(c.device_clip) and c.device_clip >= 1, "finite, >= 1"),
        ("criteria.aged_vs_fresh_pairs", c.aged_vs_fresh_pairs, c.aged_vs_fresh_pairs >= 2, ">= 2"),
        (
            "criteria.aged_vs_fresh_pairs_max",
            c.aged_vs_fresh_pairs_max,
            c.aged_vs_fresh_pairs_max >= c.aged_vs_fresh_pairs,
            f">= aged_vs_fresh_pairs={c.aged_vs_fresh_pairs}",
        ),
        ("criteria.aged_vs_fresh_warmup", c.aged_vs_fresh_warmup, c.aged_vs_fresh_warmup >= 0, ">= 0"),
        ("criteria.aged_vs_fresh_repeats", c.aged_vs_fresh_repeats, c.aged_vs_fresh_repeats >= 1, ">= 1"),
        (
            "criteria.bf16_comparison_steps",
            c.bf16_comparison_steps,
            c.bf16_comparison_steps is None or 1 <= c.bf16_comparison_steps <= t.steps,
            f"null or 1 <= x <= steps={t.steps}",
        ),
        (
            "criteria.fsdp_sharding_factor",
            c.fsdp_sharding_factor,
            c.fsdp_sharding_factor is None or c.fsdp_sharding_factor >= 2,
            "null (every rank) or an integer >= 2",
        ),
        (
            "criteria.grad_accum_k",
            c.grad_accum_k,
            c.grad_accum_k is None or (c.grad_accum_k >= 2 and d.batch_size % c.grad_accum_k == 0),
            f"null or >= 2 dividing batch_size={d.batch_size}",
        ),
    ]
    for name in (
        "loss_drop_min",
        "loss_match_factor",
        "smooth_slack",
        "vram_budget_gib",
        "leak_slope_max_mib_per_step",
        "stall_fraction_max",
        "device_time_drift_max",
        "aged_vs_fresh_slowdown_max",
        "host_leak_slope_max_mib_per_step",
        "aged_vs_fresh_resolution",
        "tier_seconds_target",
        "grad_match_factor",
        "vram_budget_16bit_base_gib",
        "memory_estimate_error_max",
        "build_seconds_max",
        "grad_loss_floor",
        "scaling_efficiency_min",
        "rank_failure_seconds_max",
    ):
        value = getattr(c, name)
        rules.append(
            (f"criteria.{name}", value, value is None or (_finite(value) and value > 0), "null or finite, > 0")
        )
    # A relative loss drop is at most 1 (the loss cannot fall below 0): a bar at or above it could never be met.
    rules.append(
        (
            "criteria.loss_drop_min",
            c.loss_drop_min,
            c.loss_drop_min is None or c.loss_drop_min < 1,
            "null or 0 < x < 1 (a fraction of the first window's loss)",
        )
    )
    # Likewise a share of steps: 1 or more is no bar (null switches it off).
    rules.append(
        (
            "criteria.stall_fraction_max",
            c.stall_fraction_max,
            c.stall_fraction_max is None or c.stall_fraction_max < 1,
            "null or 0 < x < 1 (a share of the steps)",
        )
    )
    floor = c.loss_match_floor
    rules.append(
        ("criteria.loss_match_floor", floor, floor is None or (_finite(floor) and floor >= 0), "null or finite, >= 0")
    )
    for key, value, ok, expected in rules:
        if not ok:
            raise ConfigError(f"{where}.{key}: {value!r} is out of range; expected {expected}")


def validate_suite_entry(e: SuiteEntry, where: str) -> None:
    """A tier-registry entry: names pytest and the file system accept, a GPU count, a description."""
    name_ok = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
    rules = [
        ("description", e.description, bool(e.description.strip()), "a non-empty line saying what the tier runs"),
        (
            "marker",
            e.marker,
            e.marker == "" or bool(name_ok.fullmatch(e.marker)),
            "a Python identifier (a pytest marker)",
        ),
        ("tests", e.tests, e.tests == "" or bool(name_ok.fullmatch(e.tests)), "a folder name under tiers/"),
        ("gpus", e.gpus, e.gpus >= 1, ">= 1"),
    ]
    names = [f.name for f in e.figures]
    rules += [("figures", names, len(set(names)) == len(names), "figure names that differ")]
    for i, f in enumerate(e.figures):
        rules += [
            (f"figures[{i}].name", f.name, bool(f.name.strip()), "a non-empty name"),
            (f"figures[{i}].clock", f.clock, f.clock in ("device", "host"), "device or host"),
            (f"figures[{i}].better", f.better, f.better in ("lower", "higher"), "lower or higher"),
        ]
    for key, value, ok, expected in rules:
        if not ok:
            raise ConfigError(f"{where}.{key}: {value!r}; expected {expected}")
