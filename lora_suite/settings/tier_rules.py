"""The rules that span a tier's settings objects (``TierConfig``): the LoRA targets and rank against the model's
projections, the sequence length against its positions, the criteria's windows against ``train.steps``, the
accumulation check's micro-batches against ``data.batch_size``.

Each settings object checks its own fields when built (``settings_rules.RULES``); a ``TierConfig`` checks these when
built too (``TierConfig.__post_init__``), so a YAML file, a ``TierConfig(...)`` made in Python and a
``dataclasses.replace`` of one are held to the same rules. ``tier_problem`` returns the first broken one as
(key, message): ``("criteria.loss_window", "10 is out of range; expected >= 1, and two windows must fit in
steps=12 when loss_drop_min is set")``; the loader places it in the file (``quick.yaml.criteria.loss_window: ...``).
"""

from __future__ import annotations

from lora_core.targets import EXPERT_PARAMETERS, TARGET_NAMES  # the system under test owns the target names

# The objects are config.py's (TierConfig and its parts), which imports this module: their names stay unimported here
# (an import for type checking only would be an import circle, tests/suite/repository/test_import_circles.py).
Check = tuple[str, object, bool, str]  # (key, value, ok, expected)


def target_shapes(a, targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA target of a Llama block of architecture ``a`` (a ``LlamaArchitecture``;
    "all-linear": every projection)."""
    head_dim = a.head_dim  # attention_head_dim where a family sets it (Gemma 2: 256), else hidden / heads
    shapes = {
        "q_proj": (a.hidden_size, a.num_attention_heads * head_dim),
        "k_proj": (a.hidden_size, a.num_key_value_heads * head_dim),
        "v_proj": (a.hidden_size, a.num_key_value_heads * head_dim),
        "o_proj": (a.num_attention_heads * head_dim, a.hidden_size),
        "gate_proj": (a.hidden_size, a.intermediate_size),
        "up_proj": (a.hidden_size, a.intermediate_size),
        "down_proj": (a.intermediate_size, a.hidden_size),
    }
    return shapes if "all-linear" in targets else {t: shapes[t] for t in targets if t in shapes}


def tier_problem(cfg) -> tuple[str, str] | None:
    """(key, message after the key) of the first rule across the objects of ``cfg`` (a ``TierConfig``) that it
    breaks, else None."""
    unknown = [t for t in cfg.lora.targets if t not in TARGET_NAMES + ("all-linear",)]
    if unknown:
        return "lora.targets", f"{unknown} not among {TARGET_NAMES} or 'all-linear'"
    experts = cfg.lora.target_parameters
    if experts and not cfg.model.architecture.num_experts:
        return "lora.target_parameters", (
            f"{list(experts)} adapts expert parameters, but model {cfg.model.name} (family "
            f"{cfg.model.architecture.family}) has no experts"
        )
    if odd := [t for t in experts if t.rsplit(".", 1)[-1] not in EXPERT_PARAMETERS]:
        return "lora.target_parameters", f"{odd} name no expert parameter; expected names ending in {EXPERT_PARAMETERS}"
    for key, value, ok, expected in _model_checks(cfg) + _criteria_checks(cfg.criteria, cfg.train, cfg.data):
        if not ok:
            return key, f"{value!r} is out of range; expected {expected}"
    return None


def _model_checks(cfg) -> list[Check]:
    """The rank against the smallest side of the targets' projections (a larger rank is not low-rank), the sequence
    length against the model's positions."""
    a, d, r = cfg.model.architecture, cfg.data, cfg.lora.r
    low, name = min((min(io), name) for name, io in target_shapes(a, cfg.lora.targets).items())
    return [
        ("lora.r", r, r <= low, f"1 <= r <= {low} (min(in, out) of {name}: a larger rank is not low-rank)"),
        (
            "data.seq_len",
            d.seq_len,
            d.seq_len <= a.max_position_embeddings,
            f"2 <= seq_len <= max_position_embeddings={a.max_position_embeddings}",
        ),
    ]


def _any_timed_criterion(c) -> bool:
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


def _criteria_checks(c, t, d) -> list[Check]:
    """The windows of the criteria ``c`` against the steps of ``t`` (two windows fit in the steps they judge: those
    after fit_after_step for the timed ones), the accumulation check's micro-batches against ``d``'s batch_size."""
    after_fit = t.steps - c.fit_after_step
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
            c.fit_after_step < t.steps or not _any_timed_criterion(c),
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
            "criteria.resume_at_step",
            c.resume_at_step,
            c.resume_at_step is None or c.resume_at_step < t.steps,
            f"null or 1 <= x < steps={t.steps} (a resumed run trains on from that step)",
        ),
        (
            "criteria.grad_accum_k",
            c.grad_accum_k,
            c.grad_accum_k is None or d.batch_size % c.grad_accum_k == 0,
            f"null or >= 2 dividing batch_size={d.batch_size}",
        ),
    ]
