"""Typed, frozen configuration of a tier run; YAML is read once, here, at the edge.

``load_tier_config("configs/quick.yaml")`` returns a ``TierConfig``; the model section names a file
``configs/models/<name>.yaml`` holding the architecture. Every unknown key is an error that names the
key and the file; nothing below this module sees a dict.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
WEIGHTS_MODES = ("auto", "pretrained", "random")
TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ConfigError(ValueError):
    """A config file is malformed, has an unknown key, or a value out of range."""


@dataclass(frozen=True)
class LlamaArchitecture:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class ModelConfig:
    name: str
    checkpoint: str  # the Hugging Face id of the real checkpoint (looked up in the local cache only)
    architecture: LlamaArchitecture
    local_path: str | None = None  # a directory with config.json + weights; wins over the HF cache


@dataclass(frozen=True)
class LoRASettings:
    targets: tuple[str, ...] = ("q_proj", "v_proj")  # or ("all-linear",)
    r: int = 8
    alpha: float = 16
    use_rslora: bool = False
    adapter_dtype: str = "float32"  # PEFT's default: fp32 adapters on a 16-bit base
    quantize: str | None = None  # None (16-bit base) or "nf4"


@dataclass(frozen=True)
class DataSettings:
    source: str = "embedded"  # embedded | jsonl
    path: str | None = None  # the Alpaca-format JSONL file when source is jsonl
    batch_size: int = 8
    seq_len: int = 256
    seed: int = 0
    # embedded only: 0 draws fresh windows every step; N > 0 cycles through N fixed windows (N = batch_size
    # is one fixed batch: the "overfit one batch" check of a training loop)
    pool: int = 0


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 10
    lr: float = 1e-3
    warmup_steps: int = 0
    schedule: str = "cosine"  # cosine | linear | constant (after warm-up)
    min_lr_ratio: float = 0.1  # the decay ends at lr * min_lr_ratio
    grad_accum: int = 1
    gradient_checkpointing: bool = False
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0  # None: no clipping (the norm is still recorded)
    log_every: int = 10
    seed: int = 0


@dataclass(frozen=True)
class Criteria:
    """Pass/fail thresholds; which apply depends on the tier. Each YAML value carries its provenance."""

    loss_drop_min: float | None = None  # (mean first window - mean last window) / mean first window
    loss_window: int = 10  # steps per window for the loss-drop and smoothed-loss checks
    # Per-step loss match of the backend under test against the torch reference (and PEFT):
    #   |loss_ours - loss_ref| / loss_ref <= max(loss_match_factor * e(t), loss_match_floor), where e(t) is the
    #   running max of the same relative gap between the reference and a control run whose initial lora_A
    #   is perturbed elementwise by a relative control_perturbation (rounding-level noise).
    loss_match_factor: float | None = None
    loss_match_floor: float | None = None
    control_perturbation: float = 2.0**-8  # bf16 unit roundoff
    smooth_window: int = 50  # steps per window of the smoothed-loss check (extended tier)
    smooth_slack: float | None = None  # a window mean may exceed the previous one by at most this fraction
    checkpoint_roundtrip: bool = False  # save adapters, reload into a fresh model, compare logits
    bf16_comparison_steps: int | None = None  # NF4 tiers: steps of the same config on a 16-bit base (None: all)
    vram_budget_gib: float | None = None  # peak torch-allocated memory
    leak_slope_max_mib_per_step: float | None = None
    fit_after_step: int = 50  # the leak fit and throughput checks ignore the warm-up steps before this
    step_time_cv_max: float | None = None  # std / mean of step time after warm-up
    throughput_drift_max: float | None = None  # relative fall of tokens/s, last vs first window after warm-up
    tier_seconds_max: float | None = None  # wall time of the tier's main test, model build included


@dataclass(frozen=True)
class TierConfig:
    tier: str
    model: ModelConfig
    weights: str = "auto"
    dtype: str = "bfloat16"
    backend: str | None = None  # None: cupy on a GPU (the --backend option overrides)
    lora: LoRASettings = field(default_factory=LoRASettings)
    data: DataSettings = field(default_factory=DataSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    criteria: Criteria = field(default_factory=Criteria)
    source: str = ""  # the YAML file this came from


def _build(cls, raw, where: str):
    """Build dataclass ``cls`` from mapping ``raw``; unknown keys and wrong types raise ConfigError."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}: {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        kwargs[key] = _coerce(hints[key], value, f"{where}.{key}")
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
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
    if hint in (int, bool, str) and isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {value!r}")


def _read_yaml(path: Path):
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: malformed YAML: {exc}") from exc


def load_model_config(name_or_path: str | Path, config_dir: Path = CONFIG_DIR) -> ModelConfig:
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):  # a bare name (names may contain dots: tinyllama-1.1b)
        path = config_dir / "models" / f"{name_or_path}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in (config_dir / "models").glob("*.yaml"))
        raise ConfigError(f"model config {name_or_path!r} not found at {path}; known models: {known}")
    return _build(ModelConfig, _read_yaml(path), str(path))


def load_tier_config(path: str | Path, config_dir: Path | None = None) -> TierConfig:
    path = Path(path)
    if path.suffix not in (".yaml", ".yml") and not path.exists():
        path = (config_dir or CONFIG_DIR) / f"{path}.yaml"
    config_dir = config_dir or path.resolve().parent
    raw = _read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    raw = dict(raw)
    model_ref = raw.get("model")
    if not isinstance(model_ref, str):
        raise ConfigError(f"{path}.model: expected the name of a file in {config_dir / 'models'}, got {model_ref!r}")
    raw["model"] = dataclasses.asdict(load_model_config(model_ref, config_dir))
    cfg = _build(TierConfig, raw, str(path))
    cfg = dataclasses.replace(cfg, source=str(path))
    validate(cfg)
    return cfg


def validate(cfg: TierConfig) -> None:
    where = cfg.source or cfg.tier
    if cfg.weights not in WEIGHTS_MODES:
        raise ConfigError(f"{where}.weights: {cfg.weights!r} is not one of {WEIGHTS_MODES}")
    if cfg.dtype not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"{where}.dtype: {cfg.dtype!r} is not bfloat16, float16 or float32")
    if cfg.backend not in (None, "cupy", "torch"):
        raise ConfigError(f"{where}.backend: {cfg.backend!r} is not cupy, torch or null")
    bad = [t for t in cfg.lora.targets if t not in TARGET_NAMES + ("all-linear",)]
    if bad or not cfg.lora.targets:
        raise ConfigError(f"{where}.lora.targets: {list(bad or cfg.lora.targets)} not among {TARGET_NAMES} or 'all-linear'")
    if cfg.lora.quantize not in (None, "nf4"):
        raise ConfigError(f"{where}.lora.quantize: {cfg.lora.quantize!r} is not null or nf4")
    if cfg.lora.adapter_dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"{where}.lora.adapter_dtype: {cfg.lora.adapter_dtype!r} is not float32, bfloat16 or float16")
    if cfg.data.source not in ("embedded", "jsonl") or (cfg.data.source == "jsonl" and not cfg.data.path):
        raise ConfigError(f"{where}.data: source {cfg.data.source!r} needs to be 'embedded' or 'jsonl' with a path")
    if cfg.train.schedule not in ("cosine", "linear", "constant"):
        raise ConfigError(f"{where}.train.schedule: {cfg.train.schedule!r} is not cosine, linear or constant")
    for name, value in (("lora.r", cfg.lora.r), ("data.batch_size", cfg.data.batch_size),
                        ("data.seq_len", cfg.data.seq_len), ("train.steps", cfg.train.steps),
                        ("train.grad_accum", cfg.train.grad_accum), ("train.log_every", cfg.train.log_every)):
        if value < 1:
            raise ConfigError(f"{where}.{name}: {value} must be >= 1")
    if not 0 <= cfg.train.warmup_steps < cfg.train.steps:
        raise ConfigError(f"{where}.train.warmup_steps: {cfg.train.warmup_steps} must be in [0, steps={cfg.train.steps})")
    if cfg.data.pool < 0:
        raise ConfigError(f"{where}.data.pool: {cfg.data.pool} must be >= 0")
    if cfg.train.lr <= 0:
        raise ConfigError(f"{where}.train.lr: {cfg.train.lr} must be > 0")
