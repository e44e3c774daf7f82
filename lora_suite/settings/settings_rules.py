"""The allowed values of every settings object, written once (``RULES``), and the check each one runs when built.

Each frozen dataclass of ``lora_suite.settings.config`` (``AdapterSpec`` included: the LoRA settings, the YAML's lora
section and what an implementation is given) checks its own field types and rules on construction
(``config.Checked``): ``TrainSettings(lr=1e30)`` raises ``TrainSettings.lr: 1e+30 is out of range; expected finite,
> 0 and <= 1``, and the YAML loader reports the same words with the file's location (``configs/quick.yaml.train.lr:
...``). A rule here involves one object's fields only; the rules that span a tier's objects (a rank against the
model's shapes, windows against train.steps) are ``TierConfig``'s (``lora_suite.settings.tier_rules``).

Every number of a settings object has its rule here, named by its field, one line each
(``tests/suite/settings/test_every_number_has_a_rule.py`` fails on a numeric field without one). What a rule is and
how it words its message: ``lora_suite.settings.rule_kinds``; the type checks before the rules:
``lora_suite.settings.field_types``.
"""

from __future__ import annotations

import math
import re

from lora_suite.settings.adapter_dtype import ADAPTER_DTYPES
from lora_suite.settings.field_types import type_problem
from lora_suite.settings.rule_kinds import (
    EXPECTED,
    NOT_AMONG,
    NOT_ONE_OF,
    OUT_OF_RANGE,
    Rule,
    between,
    holds,
    one_of,
    stored,
)

WEIGHTS_MODES = ("auto", "pretrained", "random")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ARCHITECTURE_FAMILIES = ("llama", "qwen2", "gemma2", "qwen3_moe")  # what lora_suite.engine.models builds
MOE_FAMILIES = ("qwen3_moe",)  # of them, those whose MLPs are experts (LlamaArchitecture.num_experts and the rest)
NEEDS = "{value}; {expected}"


def first_problem(obj) -> tuple[str, str] | None:
    """(field, message after the key) of the first wrong type, else the first broken rule of ``obj``, else None."""
    wrong = type_problem(obj)
    if wrong is not None:
        return wrong
    for rule in rules_of(type(obj)):
        if (problem := rule.problem(obj)) is not None:
            return rule.field, problem
    return None


def rules_of(cls) -> tuple[Rule, ...]:
    """The rules of ``cls`` (or of the settings class it extends)."""
    return next((RULES[c.__name__] for c in cls.__mro__ if c.__name__ in RULES), ())


def _entry(entry, kind) -> bool:
    """Whether ``entry`` is "name=value" with a name and a value of ``kind`` (int: >= 1; float: finite, > 0)."""
    if not isinstance(entry, str) or "=" not in entry:
        return False
    name, value = entry.split("=", 1)
    try:
        number = kind(value)
    except ValueError:
        return False
    return bool(name.strip()) and (number >= 1 if kind is int else math.isfinite(number) and number > 0)


def _nonblank(v, obj) -> bool:
    return bool(v.strip())


def _size(field: str) -> Rule:
    """A count or a size of the model: at least 1."""
    return between(field, lo=1)


def _positive(field: str) -> Rule:
    """A threshold or a budget: off (null) or a positive number."""
    return between(field, lo=0, lo_open=True, finite=True, null=True)


def _multiple_of(field: str, of: str) -> Rule:
    """``field`` a multiple of the field ``of`` (broken by ``of`` = ``field`` + 1)."""
    return holds(
        field,
        lambda v, obj: v % stored(obj, of) == 0,
        f"a multiple of {of}={{{of}}}",
        lambda obj: [{of: stored(obj, field) + 1}],
        form=OUT_OF_RANGE,
    )


def _empty_or_identifier(field: str, expected: str, bad: str) -> Rule:
    """``field`` empty (unset) or a Python identifier, worded by ``expected``; broken by the value ``bad``."""
    return holds(field, lambda v, obj: v == "" or bool(IDENTIFIER.fullmatch(v)), expected, lambda obj: [{field: bad}])


_DTYPES_OR_NONE = (*ADAPTER_DTYPES, None)

# AdapterSpec.init's values: PEFT's init_lora_weights True, "gaussian", False, "pissa", "olora"
INITS = ("default", "gaussian", "random_b", "pissa", "olora")

# class name -> its rules, checked in order (the first broken one is reported)
RULES: dict[str, tuple[Rule, ...]] = {
    "LlamaArchitecture": (
        _size("hidden_size"),
        _size("intermediate_size"),
        _size("num_hidden_layers"),
        _size("num_attention_heads"),
        _size("num_key_value_heads"),
        _size("vocab_size"),
        _size("max_position_embeddings"),
        # attention splits the hidden size into heads, and the heads into groups sharing a key/value head
        _multiple_of("hidden_size", "num_attention_heads"),
        between("attention_head_dim", lo=1, null=True),
        _multiple_of("num_attention_heads", "num_key_value_heads"),
        between("rope_theta", lo=0, lo_open=True, finite=True),
        between("rms_norm_eps", lo=0, lo_open=True, finite=True),
        one_of("family", ARCHITECTURE_FAMILIES),
        holds(
            "num_experts",
            lambda v, obj: v >= 2 if stored(obj, "family") in MOE_FAMILIES else v == 0,
            f"at least 2 for a mixture-of-experts family {list(MOE_FAMILIES)}, 0 for family={{family}}",
            lambda obj: [{"num_experts": 1}],
        ),
        holds(
            "num_experts_per_tok",
            lambda v, obj: 1 <= v <= stored(obj, "num_experts") if stored(obj, "family") in MOE_FAMILIES else v == 0,
            "1 <= k <= num_experts={num_experts} (0 for a dense family)",
            lambda obj: [{"num_experts_per_tok": stored(obj, "num_experts") + 1}],
        ),
        holds(
            "moe_intermediate_size",
            lambda v, obj: v >= 1 if stored(obj, "family") in MOE_FAMILIES else v == 0,
            f">= 1 for a mixture-of-experts family {list(MOE_FAMILIES)}, 0 for family={{family}}",
            lambda obj: [{"moe_intermediate_size": 0 if stored(obj, "family") in MOE_FAMILIES else 1}],
        ),
    ),
    # The LoRA settings: the YAML's lora section and the spec an implementation is given (one class). Which target
    # names exist is the tier's rule against its model (tier_rules) or the implementation's to judge.
    "AdapterSpec": (
        holds(
            "targets",
            lambda v, obj: len(v) > 0,
            "the target names: a non-empty list of projection names, or ['all-linear']",
            lambda obj: [{"targets": ()}],
            form=NOT_AMONG,
        ),
        between("r", lo=1, text="1 <= r <= min(in, out) of each target (the model's shapes bound it)"),
        between(
            "alpha", lo=0, lo_open=True, finite=True, note="alpha 0 makes the adapter a no-op: nothing would be tested"
        ),
        holds(
            "adapter_dtype",
            lambda v, obj: v is None or (isinstance(v, str) and v in ADAPTER_DTYPES),
            f"{list(_DTYPES_OR_NONE)} (a torch floating-point dtype or its name; None: the base weight's dtype)",
            lambda obj: [{"adapter_dtype": "int8"}],
            form=NOT_ONE_OF,
        ),
        one_of("quantize", (None, "nf4")),
        holds(
            "rank_pattern",
            lambda v, obj: all(_entry(e, int) for e in v),
            "entries 'name=r', each r a whole number >= 1 (PEFT's rank_pattern)",
            lambda obj: [{"rank_pattern": ("v_proj=0",)}],
        ),
        holds(
            "alpha_pattern",
            lambda v, obj: all(_entry(e, float) for e in v),
            "entries 'name=alpha', each alpha finite and > 0 (PEFT's alpha_pattern)",
            lambda obj: [{"alpha_pattern": ("v_proj=nan",)}],
        ),
        holds(
            "layers_to_transform",
            lambda v, obj: all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v),
            "decoder layer indices, whole numbers >= 0 (PEFT's layers_to_transform; empty: every layer)",
            lambda obj: [{"layers_to_transform": (-1,)}],
        ),
        holds(
            "modules_to_save",
            lambda v, obj: all(isinstance(n, str) and n.isidentifier() for n in v),
            "leaf module names such as 'lm_head' (PEFT's modules_to_save)",
            lambda obj: [{"modules_to_save": ("lm head",)}],
        ),
        one_of("init", INITS),
        holds(
            "target_parameters",
            lambda v, obj: all(isinstance(n, str) and all(part.isidentifier() for part in n.split(".")) for n in v),
            "parameter names or dotted suffixes such as 'mlp.experts.gate_up_proj' (PEFT's target_parameters)",
            lambda obj: [{"target_parameters": ("experts.*",)}],
        ),
    ),
    "DataSettings": (
        one_of("source", ("embedded", "jsonl")),
        holds(
            "path",
            lambda v, d: bool(v),
            "source 'jsonl' needs the path of an Alpaca-format JSONL file",
            lambda d: [{"path": None}],
            form=NEEDS,
            when=("source", "jsonl"),
        ),
        between("batch_size", lo=1),
        between("seq_len", lo=2, text="2 <= seq_len <= max_position_embeddings of the model"),
        between("pool", lo=0, note="0: fresh windows every step"),
        between("seed", lo=0),
    ),
    "TrainSettings": (
        between("steps", lo=1),
        # AdamW moves each adapter value by about lr a step: above 1 no run learns (issue 28: lr 1e30 "trained" to
        # the end with a gradient norm of 0 and no complaint)
        between("lr", lo=0, hi=1, lo_open=True, finite=True, text="finite, > 0 and <= 1"),
        between("warmup_steps", lo=0, hi="steps", hi_open=True, text="0 <= warmup_steps < steps={steps}"),
        one_of("schedule", ("cosine", "linear", "constant")),
        between("min_lr_ratio", lo=0, hi=1, finite=True),  # the decay ends at lr * min_lr_ratio
        between("grad_accum", lo=1),
        between("weight_decay", lo=0, finite=True),
        between(
            "max_grad_norm",
            lo=0,
            lo_open=True,
            finite=True,
            null=True,
            text="null (no clipping) or finite, > 0",
            note="a negative norm flips the gradient, 0 zeroes it",
        ),
        between("log_every", lo=1),
        between("seed", lo=0),
        between("host_probe_ops", lo=0, hi=100_000, text="0 (off) <= x <= 100000"),
        between("graph_warmup_steps", lo=1),
        between(
            "graph_warmup_steps",
            hi="steps",
            hi_open=True,
            when=("cuda_graph", True),
            text="< steps={steps} with cuda_graph",
            note="CUDA graphs need eager warm-up steps before the capture",
        ),
    ),
    # Each threshold and budget is off (null) or a positive number (_positive); a window, a count or a factor has its
    # own range. Field order, except that a bound's upper rule follows its _positive one.
    "Criteria": (
        _positive("loss_drop_min"),
        # A relative loss drop is at most 1 (the loss cannot fall below 0): a bar at or above it could never be met.
        between(
            "loss_drop_min",
            hi=1,
            hi_open=True,
            null=True,
            text="null or 0 < x < 1",
            note="a fraction of the first window's loss",
        ),
        between("loss_window", lo=1),
        _positive("loss_match_factor"),
        between("loss_match_floor", lo=0, finite=True, null=True),
        between("control_perturbation", lo=0, hi=1, lo_open=True, hi_open=True, finite=True),
        between("control_runs", lo=1, hi=16),
        between("smooth_window", lo=1),
        _positive("smooth_slack"),
        between("bf16_comparison_steps", lo=1, null=True),
        between("resume_at_step", lo=1, null=True),
        _positive("vram_budget_gib"),
        _positive("vram_budget_16bit_base_gib"),
        _positive("memory_estimate_error_max"),
        _positive("build_seconds_max"),
        _positive("leak_slope_max_mib_per_step"),
        between("fit_after_step", lo=0),
        between("stall_factor", lo=1, lo_open=True, finite=True),  # a stall is a step this many times the median
        _positive("stall_fraction_max"),
        # Likewise a share of steps: 1 or more is no bar (null switches it off).
        between(
            "stall_fraction_max", hi=1, hi_open=True, null=True, text="null or 0 < x < 1", note="a share of the steps"
        ),
        between("drift_noise_z", lo=0, finite=True),
        _positive("host_leak_slope_max_mib_per_step"),
        _positive("device_time_drift_max"),
        between("device_window", lo=2),
        between("device_clip", lo=1, finite=True),
        _positive("aged_vs_fresh_slowdown_max"),
        between("aged_vs_fresh_pairs", lo=2),
        between("aged_vs_fresh_pairs_max", lo="aged_vs_fresh_pairs"),
        _positive("aged_vs_fresh_resolution"),
        between("aged_vs_fresh_warmup", lo=0),
        between("aged_vs_fresh_repeats", lo=1),
        _positive("tier_seconds_target"),
        _positive("grad_match_factor"),
        between("grad_accum_k", lo=2, null=True),
        _positive("grad_loss_floor"),
        _positive("scaling_efficiency_min"),
        _positive("rank_failure_seconds_max"),
        _positive("rendezvous_join_seconds"),
        between("fsdp_sharding_factor", lo=2, null=True, text="null (every rank) or an integer >= 2"),
    ),
    "FigureSpec": (
        holds("name", _nonblank, "a non-empty name", lambda f: [{"name": " "}]),
        one_of("clock", ("device", "host"), text="device or host", form=EXPECTED),
        one_of("better", ("lower", "higher"), text="lower or higher", form=EXPECTED),
    ),
    "SuiteEntry": (
        holds("description", _nonblank, "a non-empty line saying what the tier runs", lambda e: [{"description": ""}]),
        _empty_or_identifier("marker", "a Python identifier (a pytest marker)", "two words"),
        _empty_or_identifier("tests", "a folder name under tiers/", "../elsewhere"),
        between("gpus", lo=1, form=EXPECTED),
        between("order", lo=0, form=EXPECTED),
        holds(
            "figures",
            lambda v, e: len({f.name for f in v}) == len(v),
            "figure names that differ",
            lambda e: [{"figures": e.figures[:1] * 2}] if e.figures else [],
            show=lambda v: [f.name for f in v],
        ),
    ),
    "TierConfig": (
        one_of("weights", WEIGHTS_MODES),
        one_of("dtype", ("bfloat16", "float16", "float32")),
    ),
}
