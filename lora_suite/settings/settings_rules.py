"""The allowed values of every settings object, written once (``RULES``).

Each frozen dataclass of ``lora_suite.settings.config`` (and ``AdapterSpec`` of the implementation contract) checks its
own field types and rules on construction (``config.Checked``): ``TrainSettings(lr=1e30)`` raises
``TrainSettings.lr: 1e+30 is out of range; expected finite, > 0 and <= 1``, and the YAML loader reports the same
words with the file's location (``configs/quick.yaml.train.lr: ...``). A rule here involves one object's fields
only; rules that span objects (a rank against the model's shapes, windows against train.steps) are the loader's
(``lora_suite.settings.loader.validate``).

A rule also says which values break it (``Rule.breaking``): the tests feed each of them to both paths.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass

OUT_OF_RANGE = "{value} is out of range; expected {expected}"
NOT_ONE_OF = "{value} is not one of {expected}"
EXPECTED = "{value}; expected {expected}"
NOT_AMONG = "{value} not among {expected}"
NEEDS = "{value}; {expected}"

WEIGHTS_MODES = ("auto", "pretrained", "random")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
Changes = dict[str, object]


@dataclass(frozen=True)
class Rule:
    """One condition on one field of a settings object. ``expected`` is formatted with the object's fields
    (``"< steps={steps}"``) into the message ``form``; ``when`` (field, value): the rule applies only while that
    field holds that value; ``bad(obj)``: field changes that break this rule and none before it."""

    field: str
    ok: Callable[[object, object], bool]  # ok(value, obj)
    expected: str
    bad: Callable[[object], list[Changes]]
    form: str = OUT_OF_RANGE
    when: tuple[str, object] | None = None
    show: Callable[[object], object] | None = None  # what of the value the message shows (default: the value)

    def problem(self, obj) -> str | None:
        """The message after the key ("0 is out of range; expected >= 1") when ``obj`` breaks the rule, else None."""
        if self.when is not None and getattr(obj, self.when[0]) != self.when[1]:
            return None
        value = getattr(obj, self.field)
        if self.ok(value, obj):
            return None
        shown = self.show(value) if self.show else value
        return self.form.format(value=_shown(shown), expected=self.expected.format_map(_fields(obj)))

    def breaking(self, obj) -> list[Changes]:
        """Changes to ``obj`` that break this rule (``when``'s condition included): the tests' bad values."""
        condition = {self.when[0]: self.when[1]} if self.when else {}
        return [{**condition, **change} for change in self.bad(obj)]


def _shown(value) -> str:
    """A value as a message shows it: tuples as the lists YAML writes."""
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def _fields(obj) -> dict[str, object]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def between(field, lo=None, hi=None, *, lo_open=False, hi_open=False, finite=False, null=False, **kw) -> Rule:
    """A number in [lo, hi] (``lo_open``/``hi_open``: that end excluded; either bound may be left out or name another
    field of the object); ``finite``: NaN and ±inf refused; ``null``: None allowed. ``text`` replaces the generated
    range words, ``note`` adds why in parentheses; ``form`` and ``when`` as in ``Rule``."""

    def ok(v, obj) -> bool:
        if v is None:
            return null
        low, high = _bound(lo, obj), _bound(hi, obj)
        return (
            (not finite or math.isfinite(v))
            and (low is None or (v > low if lo_open else v >= low))
            and (high is None or (v < high if hi_open else v <= high))
        )

    def bad(obj) -> list[Changes]:
        kind = scalar_type(type(obj), field)
        step = kind(1)
        values = [] if lo is None else [kind(_bound(lo, obj) - (0 if lo_open else step))]
        values += [] if hi is None else [kind(_bound(hi, obj) + (0 if hi_open else step))]
        values += [math.nan, math.inf] if finite else []
        return [{field: v} for v in values]

    text = kw.pop("text", None) or ("null or " if null else "") + _range_words(lo, hi, lo_open, hi_open, finite)
    return _rule(field, ok, text, bad, **kw)


def _bound(b, obj):
    return getattr(obj, b) if isinstance(b, str) else b


def _range_words(lo, hi, lo_open, hi_open, finite) -> str:
    """The generated words of a range: ">= 1", "finite, > 0", "0 < x < 1"; a bound that names a field shows its value
    (">= aged_vs_fresh_pairs={aged_vs_fresh_pairs}")."""

    def word(b) -> str:
        return f"{b}={{{b}}}" if isinstance(b, str) else str(b)

    if lo is not None and hi is not None:
        return f"{word(lo)} {'<' if lo_open else '<='} x {'<' if hi_open else '<='} {word(hi)}"
    if lo is not None:
        return ("finite, " if finite else "") + f"{'>' if lo_open else '>='} {word(lo)}"
    return ("finite, " if finite else "") + f"{'<' if hi_open else '<='} {word(hi)}"


def one_of(field, allowed: tuple, *, text: str | None = None, form: str = NOT_ONE_OF) -> Rule:
    """One of ``allowed`` (named as a list unless ``text`` words it)."""
    return Rule(
        field, lambda v, obj: v in allowed, text or repr(list(allowed)), lambda obj: [{field: f"no-{field}"}], form
    )


def _rule(field, ok, expected, bad, *, note: str = "", form: str = OUT_OF_RANGE, when=None, show=None) -> Rule:
    return Rule(field, ok, expected + (f" ({note})" if note else ""), bad, form, when, show)


def scalar_type(cls: type, field: str) -> type:
    """The int, float, str or bool a field holds (its annotation without ``| None``)."""
    hint = field_types(cls)[field]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint


@functools.cache
def field_types(cls: type) -> dict[str, typing.Any]:
    """Each field's annotation, resolved; one that cannot be resolved at run time (``AdapterSpec.adapter_dtype``'s
    torch.dtype, imported for type checkers only) is left out: its rule judges it."""
    names = vars(sys.modules[cls.__module__])
    out = {}
    for f in dataclasses.fields(cls):
        try:
            out[f.name] = eval(f.type, names) if isinstance(f.type, str) else f.type  # the class's own annotation
        except (NameError, AttributeError):
            continue
    return out


def type_problem(obj) -> tuple[str, str] | None:
    """(field, "expected int, got '8'") for the first field whose value is not of its annotated type, else None.
    bool is not an int here, and a float field takes an int."""
    cls: type = type(obj)  # annotated: mypy does not take a type[...] for functools.cache's Hashable argument
    for name, hint in field_types(cls).items():
        value = getattr(obj, name)
        if not _is(hint, value):
            return name, f"expected {_type_words(hint)}, got {value!r}"
    return None


def _is(hint, value) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is(a, value) for a in args)
    if origin is tuple:
        return isinstance(value, tuple) and all(_is(args[0], v) for v in value)
    if hint in (int, float):
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # an annotation this check does not know: its rules judge the value


def _type_words(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_words(a) for a in args)
    if origin is tuple:
        return f"a tuple of {_type_words(args[0])}"
    return {float: "a number", type(None): "None"}.get(hint, getattr(hint, "__name__", str(hint)))


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


def holds(field, ok, expected: str, bad, **kw) -> Rule:
    """A condition ``ok(value, obj)`` worded by ``expected``; ``bad(obj)`` lists changes that break it; ``note``,
    ``form`` (here ``EXPECTED`` unless given), ``when`` and ``show`` as in ``Rule``."""
    return _rule(field, ok, expected, bad, **{"form": EXPECTED, **kw})


def _nonblank(v, obj) -> bool:
    return bool(v.strip())


def _multiple_of(field: str, of: str) -> Rule:
    """``field`` a multiple of the field ``of`` (broken by ``of`` = ``field`` + 1)."""
    return holds(
        field,
        lambda v, obj: v % getattr(obj, of) == 0,
        f"a multiple of {of}={{{of}}}",
        lambda obj: [{of: getattr(obj, field) + 1}],
        form=OUT_OF_RANGE,
    )


def _empty_or_identifier(field: str, expected: str, bad: str) -> Rule:
    """``field`` empty (unset) or a Python identifier, worded by ``expected``; broken by the value ``bad``."""
    return holds(field, lambda v, obj: v == "" or bool(IDENTIFIER.fullmatch(v)), expected, lambda obj: [{field: bad}])


def _float_dtype_or_none(v, obj) -> bool:
    """None or a torch floating-point dtype (torch is imported wherever a dtype was made: never here)."""
    torch = sys.modules.get("torch")
    return v is None or (torch is not None and isinstance(v, torch.dtype) and v.is_floating_point)


# LoRASettings and AdapterSpec share these: the YAML's lora section and the spec an implementation is given.
_TARGETS = holds(
    "targets",
    lambda v, obj: len(v) > 0,
    "the target names: a non-empty list of projection names, or ['all-linear']",
    lambda obj: [{"targets": ()}],
    form=NOT_AMONG,
)
_RANK = between("r", lo=1, text="1 <= r <= min(in, out) of each target (the model's shapes bound it)")
_ALPHA = between(
    "alpha", lo=0, lo_open=True, finite=True, note="alpha 0 makes the adapter a no-op: nothing would be tested"
)
_QUANTIZE = one_of("quantize", (None, "nf4"))
_ARCHITECTURE_SIZES = """
    hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads vocab_size
    max_position_embeddings
""".split()  # counts and sizes: at least 1
ARCHITECTURE_FAMILIES = ("llama", "qwen2", "gemma2")  # what lora_suite.engine.models builds (LlamaArchitecture.family)
# thresholds and budgets: off (null) or a positive number
_POSITIVE_CRITERIA = """
    loss_drop_min loss_match_factor smooth_slack vram_budget_gib leak_slope_max_mib_per_step stall_fraction_max
    device_time_drift_max aged_vs_fresh_slowdown_max host_leak_slope_max_mib_per_step aged_vs_fresh_resolution
    tier_seconds_target grad_match_factor vram_budget_16bit_base_gib memory_estimate_error_max build_seconds_max
    grad_loss_floor scaling_efficiency_min rank_failure_seconds_max
""".split()

# class name -> its rules, checked in order (the first broken one is reported)
RULES: dict[str, tuple[Rule, ...]] = {
    "LlamaArchitecture": (
        *(between(name, lo=1) for name in _ARCHITECTURE_SIZES),
        # attention splits the hidden size into heads, and the heads into groups sharing a key/value head
        _multiple_of("hidden_size", "num_attention_heads"),
        between("attention_head_dim", lo=1, null=True),
        _multiple_of("num_attention_heads", "num_key_value_heads"),
        between("rope_theta", lo=0, lo_open=True, finite=True),
        between("rms_norm_eps", lo=0, lo_open=True, finite=True),
        one_of("family", ARCHITECTURE_FAMILIES),
    ),
    "LoRASettings": (
        _TARGETS,
        _RANK,
        _ALPHA,
        one_of("adapter_dtype", ("float32", "bfloat16", "float16")),
        _QUANTIZE,
    ),
    "AdapterSpec": (
        _TARGETS,
        _RANK,
        _ALPHA,
        holds(
            "adapter_dtype",
            _float_dtype_or_none,
            "a torch floating-point dtype, or None (the base weight's dtype)",
            lambda spec: [{"adapter_dtype": "float32"}],
        ),
        _QUANTIZE,
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
    "Criteria": (
        between("loss_window", lo=1),
        between("control_perturbation", lo=0, hi=1, lo_open=True, hi_open=True, finite=True),
        between("control_runs", lo=1, hi=16),
        between("smooth_window", lo=1),
        between("fit_after_step", lo=0),
        between("stall_factor", lo=1, lo_open=True, finite=True),  # a stall is a step this many times the median
        between("drift_noise_z", lo=0, finite=True),
        between("device_window", lo=2),
        between("device_clip", lo=1, finite=True),
        between("aged_vs_fresh_pairs", lo=2),
        between("aged_vs_fresh_pairs_max", lo="aged_vs_fresh_pairs"),
        between("aged_vs_fresh_warmup", lo=0),
        between("aged_vs_fresh_repeats", lo=1),
        between("bf16_comparison_steps", lo=1, null=True),
        between("fsdp_sharding_factor", lo=2, null=True, text="null (every rank) or an integer >= 2"),
        between("grad_accum_k", lo=2, null=True),
        *(between(name, lo=0, lo_open=True, finite=True, null=True) for name in _POSITIVE_CRITERIA),
        # A relative loss drop is at most 1 (the loss cannot fall below 0): a bar at or above it could never be met.
        between(
            "loss_drop_min",
            hi=1,
            hi_open=True,
            null=True,
            text="null or 0 < x < 1",
            note="a fraction of the first window's loss",
        ),
        # Likewise a share of steps: 1 or more is no bar (null switches it off).
        between(
            "stall_fraction_max", hi=1, hi_open=True, null=True, text="null or 0 < x < 1", note="a share of the steps"
        ),
        between("loss_match_floor", lo=0, finite=True, null=True),
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
