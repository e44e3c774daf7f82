"""Typed, frozen configuration of a tier run; YAML is read once, here, at the edge.

``load_tier_config("configs/quick.yaml")`` returns a ``TierConfig``; the model section names a file
``configs/models/<name>.yaml`` holding the architecture. Every unknown key is an error that names the
key and the file; nothing below this module sees a dict. Each settings dataclass checks its own fields when built,
from YAML or in Python (``Checked``; the rules are ``lora_suite.settings.settings_rules.RULES``), and a
``TierConfig`` checks the rules across its objects too (``lora_suite.settings.tier_rules``). The LoRA settings have
one shape, ``AdapterSpec``: the YAML's lora section and what an implementation is given.
"""

from __future__ import annotations

import importlib.resources
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from lora_suite.settings.adapter_dtype import AdapterDtype
from lora_suite.settings.settings_rules import INITS, first_problem  # noqa: F401 (INITS re-exported)
from lora_suite.settings.tier_rules import tier_problem

CONFIG_ENV = "LORA_SUITE_CONFIG_DIR"


def find_data_dir(env: str, name: str) -> Path:
    """A folder of the suite's data (``configs``, ``tiers``): ``$env`` if set; else a checkout's ``name/`` beside the
    package (it wins, so edits there take effect); else the copy shipped inside the installed package."""
    if os.environ.get(env):
        return Path(os.environ[env])
    checkout = Path(__file__).resolve().parents[2] / name
    if checkout.is_dir():
        return checkout
    return Path(str(importlib.resources.files("lora_suite") / name))


def find_config_dir() -> Path:
    """Where tier and model YAML are read from: $LORA_SUITE_CONFIG_DIR if set; else a checkout's ``configs/``
    beside the package (it wins, so edits there take effect); else the copy shipped as package data."""
    return find_data_dir(CONFIG_ENV, "configs")


CONFIG_DIR = find_config_dir()
RENAMED = {  # old key -> new key, named in the error
    "backend": "implementation",
    "tier_seconds_max": "tier_seconds_target",  # a reported target since issue 34: wall time judges the machine
}
RETIRED = {  # old key -> why it is gone, named in the error
    "throughput_drift_max": "the process-CPU-time drift judged the host's speed (issue 18); it is a diagnostic now, "
    "and device_time_drift_max and aged_vs_fresh_slowdown_max judge the code's speed",
}


_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?\.?(inf|nan)", re.IGNORECASE)


class ConfigError(ValueError):
    """A config file is malformed, has an unknown key, or a value out of range."""


class SettingsError(ConfigError):
    """A settings object built with a value its rules refuse (``lora_suite.settings.settings_rules``): ``owner`` is the
    class, ``key`` the field, ``detail`` the rest of the message ("1e+30 is out of range; expected ...")."""

    def __init__(self, owner: str, key: str, detail: str):
        super().__init__(f"{owner}.{key}: {detail}")
        self.owner, self.key, self.detail = owner, key, detail


class Checked:
    """A frozen settings dataclass that checks its field types and its rules (``settings_rules.RULES``) when built,
    by the YAML loader or in Python, and raises ``SettingsError`` naming the first wrong field."""

    def __post_init__(self) -> None:
        problem = first_problem(self)
        if problem is not None:
            raise SettingsError(type(self).__name__, *problem)


@dataclass(frozen=True)
class LlamaArchitecture(Checked):
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
    # The decoder family (settings_rules.ARCHITECTURE_FAMILIES), which lora_suite.engine.models builds: "llama",
    # "qwen2" (the same block with a bias on q, k and v: transformers' Qwen2 classes) or "gemma2" (Gemma 2's block:
    # GeGLU MLP, (1 + w) norms, soft-capped attention and logits: transformers' Gemma2 classes)
    family: str = "llama"
    attention_head_dim: int | None = None  # a head's width where it is not hidden / heads (Gemma 2: 256); None: that
    # A mixture-of-experts family ("qwen3_moe": Qwen3-MoE's block, transformers' Qwen3Moe classes, whose every MLP is
    # num_experts experts of width moe_intermediate_size held as 3-D parameters, num_experts_per_tok of them per
    # token; intermediate_size is then unused): 0 for a dense family
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class ModelConfig(Checked):
    name: str
    checkpoint: str  # the Hugging Face id of the real checkpoint (looked up in the local cache only)
    architecture: LlamaArchitecture
    local_path: str | None = None  # a directory with config.json + weights; wins over the HF cache


@dataclass(frozen=True)
class AdapterSpec(Checked):
    """The LoRA settings, in one shape: a tier YAML's ``lora`` section and what an implementation adapts
    (``LoRAImplementation.inject(model, spec)``). Checked on construction (``settings_rules.RULES["AdapterSpec"]``):
    targets a non-empty tuple of names, r >= 1, alpha finite > 0, adapter_dtype a floating-point dtype or None,
    quantize None or "nf4". Which target names exist and how large r may be are the tier's rules against its model
    (``tier_rules``), or the implementation's to judge for a model it is given."""

    targets: tuple[str, ...] = ("q_proj", "v_proj")  # projection names or ("all-linear",)
    r: int = 8
    alpha: float = 16.0
    use_rslora: bool = False  # s = alpha / sqrt(r) instead of alpha / r
    # Reads as a torch dtype (None: the base weight's dtype); set from a torch dtype or its name ("float32"): stored
    # by name, so the YAML is read without torch (adapter_dtype.py). fp32 adapters on a 16-bit base: PEFT's default.
    adapter_dtype: AdapterDtype = AdapterDtype("float32")
    quantize: str | None = None  # None (16-bit base) or "nf4"
    # Per-module overrides by leaf module name (PEFT's rank_pattern and alpha_pattern), as "name=value" entries:
    # ("v_proj=4",) gives v_proj r 4 whatever r says; a name not listed takes r and alpha
    rank_pattern: tuple[str, ...] = ()
    alpha_pattern: tuple[str, ...] = ()
    # PEFT's LoraConfig options (``contract.spec_features`` names the feature each asks of a stack, which refuses an
    # option it lacks): a bias on B; the decoder layers adapted (() all); whole modules trained and saved by leaf
    # name; the init (contract.INITS: default, gaussian, random_b, pissa, olora); DoRA
    lora_bias: bool = False
    layers_to_transform: tuple[int, ...] = ()
    modules_to_save: tuple[str, ...] = ()
    init: str = "default"
    use_dora: bool = False
    # 3-D expert parameters adapted by leaf name (PEFT's target_parameters: "gate_up_proj", "mlp.experts.down_proj"),
    # one rank-r adapter per expert
    target_parameters: tuple[str, ...] = ()

    @property
    def ranks(self) -> dict[str, int]:
        """``rank_pattern`` as {leaf name: r}."""
        return {k: int(v) for k, v in (e.split("=", 1) for e in self.rank_pattern)}

    @property
    def alphas(self) -> dict[str, float]:
        """``alpha_pattern`` as {leaf name: alpha}."""
        return {k: float(v) for k, v in (e.split("=", 1) for e in self.alpha_pattern)}

    def rank_of(self, leaf: str) -> int:
        return self.ranks.get(leaf, self.r)

    def alpha_of(self, leaf: str) -> float:
        return self.alphas.get(leaf, self.alpha)

    def scale_of(self, leaf: str) -> float:
        """The scale of the module named ``leaf``: alpha/r, or alpha/√r under rsLoRA, with its overrides."""
        r = self.rank_of(leaf)
        return self.alpha_of(leaf) / (r**0.5 if self.use_rslora else r)

    @property
    def dtype_name(self) -> str | None:
        """The adapters' dtype by name ("float32"), read without torch; None: the base weight's dtype."""
        return vars(self)["adapter_dtype"]  # as stored: a name (the field's rule refused anything else)


@dataclass(frozen=True)
class DataSettings(Checked):
    source: str = "embedded"  # embedded | jsonl
    path: str | None = None  # the Alpaca-format JSONL file when source is jsonl
    batch_size: int = 8
    seq_len: int = 256
    seed: int = 0
    # embedded only: 0 draws fresh windows every step; N > 0 cycles through N fixed windows (N = batch_size
    # is one fixed batch: the "overfit one batch" check of a training loop)
    pool: int = 0


@dataclass(frozen=True)
class TrainSettings(Checked):
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
    # After each step, time this many tiny CPU tensor ops in process CPU time (step_record.host_probe): a yardstick of
    # the host's own speed at that moment, recorded as StepRecord.host_probe_s. 0: off.
    host_probe_ops: int = 0
    # Capture forward, backward, clipping and the optimizer step in one CUDA graph and replay it (trainer.py,
    # "Captured steps"); the first graph_warmup_steps steps run eagerly on a side stream before the capture.
    cuda_graph: bool = False
    graph_warmup_steps: int = 3


@dataclass(frozen=True)
class Criteria(Checked):
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
    # Control runs, each with its own random signs of the perturbation: e(t) is the running max over all of them
    # (measure/criteria.py widest_control). One control is one sample of how far rounding noise carries a chaotic
    # trajectory; several sample it better (issue 55: configs/convergence.yaml says why three).
    control_runs: int = 1
    smooth_window: int = 50  # steps per window of the smoothed-loss check (extended tier)
    smooth_slack: float | None = None  # a window mean may exceed the previous one by at most this fraction
    checkpoint_roundtrip: bool = False  # save adapters, reload into a fresh model, compare logits
    # The resumed-run check (convergence tier): the run under test writes a checkpoint (its adapters through its own
    # save_adapter, AdamW's state, the step) after step resume_at_step - 1; a fresh model loads it and trains on to
    # train.steps, and its losses must stay in the loss-match band around the uninterrupted run's (None: not checked)
    resume_at_step: int | None = None
    bf16_comparison_steps: int | None = None  # NF4 tiers: steps of the same config on a 16-bit base (None: all)
    vram_budget_gib: float | None = None  # peak torch-allocated memory
    # The same budget when the implementation under test has no NF4 base and the tier runs on its 16-bit base
    # (declared not applicable by the implementation); None: no 16-bit budget, the check is not applicable.
    vram_budget_16bit_base_gib: float | None = None
    # |estimated - measured| / measured peak allocated memory (lora_suite/measure/memory.py's estimator)
    memory_estimate_error_max: float | None = None
    build_seconds_max: float | None = None  # model build (and adapter injection) wall time
    leak_slope_max_mib_per_step: float | None = None
    fit_after_step: int = 50  # the leak fit and throughput checks ignore the warm-up steps before this
    # Stalls: the share of steps after warm-up whose time exceeds stall_factor × the median step may be at
    # most stall_fraction_max (criteria.stall_fraction). Replaces a plain CV, which one stall or host jitter
    # dominated.
    stall_factor: float = 2.5
    stall_fraction_max: float | None = None
    drift_noise_z: float = 3.0  # how many standard errors of a median (difference) count as noise
    # Host memory: slope of the process's resident set size after fit_after_step (memory.host_rss_bytes).
    host_leak_slope_max_mib_per_step: float | None = None
    # Device time (lora_suite/measure/device_time.py): device_window profiled steps early and late after warm-up; each
    # launch clipped at device_clip x its median over the window; the drift of steps per device-second may be at
    # most device_time_drift_max + drift_noise_z standard errors (criteria.device_time_verdict).
    device_time_drift_max: float | None = None
    device_window: int = 5
    device_clip: float = 2.0
    # Aged vs fresh (lora_suite/scenarios/aged_vs_fresh.py): after the run, aged_vs_fresh_warmup steps of a fresh run, then
    # aged_vs_fresh_pairs alternating pairs (each aged_vs_fresh_repeats rounds, least CPU time per side), and 20 more
    # at a time while the allowance is above aged_vs_fresh_resolution, up to aged_vs_fresh_pairs_max; median(aged CPU
    # time / fresh) - 1 may be at most aged_vs_fresh_slowdown_max + drift_noise_z standard errors, on the log scale
    # (criteria.aged_vs_fresh_allowance).
    aged_vs_fresh_slowdown_max: float | None = None
    aged_vs_fresh_pairs: int = 40
    aged_vs_fresh_pairs_max: int = 40
    aged_vs_fresh_resolution: float | None = None
    aged_vs_fresh_warmup: int = 10
    aged_vs_fresh_repeats: int = 1
    # The whole tier's wall time, model build included: a target the report states (met or missed), never a failed
    # check, because the host's load and the GPU's other tenants move it as much as the code does (issue 34).
    tier_seconds_target: float | None = None
    # Whole-model gradient checks (quick tier): every adapter's gradient from the model under test vs an fp32
    # copy of the same model (torch reference backend), relative to the error of the 16-bit torch reference
    # itself: err_candidate <= grad_match_factor · max(err_reference, median err_reference over adapters).
    grad_match_factor: float | None = None
    grad_accum_k: int | None = None  # micro-batches in the gradient-accumulation check (None: not checked)
    grad_loss_floor: float | None = None  # the loss check's floor: factor · max(16-bit ref loss gap, this)
    # Multi-GPU tier (lora_suite/scenarios/multigpu.py): tokens/s on N GPUs ÷ (N × one GPU), floor set from a calibration
    # run (None: reported, not judged); and how long a job with a failing rank may take to end.
    scaling_efficiency_min: float | None = None
    rank_failure_seconds_max: float | None = None
    # Multinode tier (lora_suite/scenarios/multinode.py): every job's rendezvous join timeout; a job whose nodes have not
    # all joined by then ends, naming the nodes missing.
    rendezvous_join_seconds: float | None = None
    # FSDP2 (multigpu tier): the number of ranks each parameter is sharded over; null: all of them (fully_shard
    # over the whole world). The per-rank peak bound is derived from it (lora_suite.scenarios.multigpu.fsdp_peak_bound).
    fsdp_sharding_factor: int | None = None


@dataclass(frozen=True)
class FigureSpec(Checked):
    """A headline figure a tier declares (``suite.figures``) and records in its report (``RunReport.figure``): the
    nightly gate (``lora_suite.results.compare``) judges a device-clocked one with its noise rule and lists a
    host-clocked one, never failing it."""

    name: str
    unit: str
    clock: str  # device (a GPU clock, CUDA events, or the device's memory: the code's) | host (the host's speed in it)
    better: str  # lower | higher: which way a change is an improvement


@dataclass(frozen=True)
class SuiteEntry(Checked):
    """A tier's entry in the tier registry (``lora_suite.settings.registry``): how the command line and pytest find and
    run it. A YAML in configs/ with a ``suite:`` section is a tier; one without (multigpu_fsdp.yaml) is a config
    another tier reads."""

    description: str  # one line: what the tier runs (lora-suite --help lists it)
    marker: str = ""  # the pytest marker its tests carry ("": the tier's name); the plugin registers it
    tests: str = ""  # its test folder under tiers/ ("": the tier's name); the plugin marks every test in it
    gpus: int = 1  # GPUs it needs: fewer visible and its tests skip (multigpu: 2; `all` adds it only then)
    in_all: bool = True  # part of the `all` target
    order: int = 100  # position in `all` and in --help, lowest first
    figures: tuple[FigureSpec, ...] = ()  # the tier's headline figures (FigureSpec), gated night to night


@dataclass(frozen=True)
class TierConfig(Checked):
    tier: str
    model: ModelConfig
    weights: str = "auto"
    dtype: str = "bfloat16"
    # The LoRA implementation under test (lora_suite/implementations.py): cupy (default), cupy-fused, torch, peft, an
    # entry point of lora_suite.implementations, or package.module:factory. --lora-impl overrides it.
    implementation: str = "cupy"
    lora: AdapterSpec = field(default_factory=AdapterSpec)
    data: DataSettings = field(default_factory=DataSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    criteria: Criteria = field(default_factory=Criteria)
    suite: SuiteEntry | None = None  # its tier-registry entry (None: not a tier of its own)
    source: str = ""  # the YAML file this came from

    def __post_init__(self) -> None:
        """Each field's own rules, then the rules across the objects (``tier_rules``): rank vs the model's shapes,
        target names, windows vs steps. Key of the error: the object's field (``criteria.loss_window``)."""
        super().__post_init__()
        problem = tier_problem(self)
        if problem is not None:
            raise SettingsError(type(self).__name__, *problem)
