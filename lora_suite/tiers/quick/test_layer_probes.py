"""The implementation under test at the layer level, whatever it is: a probe block (q, k, v, o and a SwiGLU MLP)
adapted through its own ``inject`` and judged against float64 from the same tensors (``lora_suite.engine.probes``,
``lora_suite.judges.layer_checks``): outputs, input gradients, dA and dB over dtypes, layouts, Llama and odd shapes;
determinism, eval mode, merged weights, captured replays, accumulation, inputs without grad, NaN rows, a side
stream, autocast.

Shapes: SmolLM2-135M's and TinyLlama-1.1B's block widths, odd widths (333, 1000, 37, intermediate 1001) and an
intermediate width that is a multiple of 4 and not of 8 (1004: a vectorised kernel that assumed 8 would misread
it). Ranks 1, 8, 64 and 256. What the implementation declares it cannot do (fp32 adapters on a 16-bit base, a
16-bit base, capture, merging) is recorded as not applicable with its own reason.
"""

from __future__ import annotations

import pytest
import torch

from lora_suite.engine import probes as P
from lora_suite.harness.report import Series
from lora_suite.implementations import AdapterSpec
from lora_suite.judges import invariant_checks as I
from lora_suite.judges import layer_checks as L
from lora_suite.judges import probe_judge as PJ

pytestmark = [pytest.mark.gpu, pytest.mark.quick]

DEV = "cuda"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPE_CONFIGS = {  # name: (activation and base dtype, adapter dtype)
    "fp32": (F32, F32),
    "fp16": (F16, F16),
    "bf16": (BF16, BF16),
    "fp16-act+fp32-adapters": (F16, F32),
    "bf16-act+fp32-adapters": (BF16, F32),
}
SHAPES = (
    P.BlockShape("smollm2", 576, 576, 192, 1536),
    P.BlockShape("tinyllama", 2048, 2048, 256, 5632),
    P.BlockShape("odd", 333, 1000, 37, 1001),
    P.BlockShape("i4mod8", 256, 256, 64, 1004),
)
N_TOKENS = (1, 37, 1024)
RANK_CASES = ((SHAPES[2], 37, 1), (SHAPES[0], 37, 64), (SHAPES[3], 37, 256))  # the rank sweep, 2-D only
R, SCALE = 8, 2.0
P_2D = "2-D inputs in the probe grids (run as (1, tokens, features) instead)"


def _spec(impl, adapter_dtype, r=R, quantize=None) -> AdapterSpec:
    if quantize is None and impl.reason_not_applicable("bf16_base"):
        quantize = "nf4"  # an implementation whose base is always 4-bit: its own storage, read back by the probe
    return AdapterSpec(P.PROBE_TARGETS, r, SCALE * r, adapter_dtype=adapter_dtype, quantize=quantize)


def _applicable(check, impl, dtype, adapter_dtype) -> bool:
    why = impl.reason_not_applicable("fp32_adapters_on_16bit_base")
    if why and adapter_dtype == F32 and dtype != F32:
        check.not_applicable("every check of this dtype configuration (fp32 adapters on a 16-bit base)", why)
        return False
    return True


def _grid(impl, check, run_report, label, dtype, adapter_dtype, cases, layout, quantize=None):
    rows, judged = [], []
    served = set()
    no_2d = impl.reason_not_applicable("inputs_2d") if layout in ("2d", "noncontig") else None
    if no_2d:  # one record for the module, however many grids it changes
        run_report.mark_module_not_applicable(__name__.rsplit(".", 1)[-1] + ".py", P_2D, no_2d)
    for i, (shape, n, r) in enumerate(cases):
        lead = (1, n) if no_2d else (n,)
        probe = P.build_probe(impl, shape, _spec(impl, adapter_dtype, r, quantize), dtype, DEV, seed=i)
        inputs = P.random_inputs(shape, lead, dtype, DEV, layout=layout, seed=100 + i)
        got, errs = L.parity_errors(probe, inputs)
        served.add(impl.served_by(probe.block))
        case = f"{shape.name} N={n} r={r}"
        judged.append((case, errs, PJ.dtype_errors(probe, inputs, got)))
        worst = max(errs, key=lambda e: e.scaled_err / e.tol)
        rows.append(
            (shape.name, n, r, worst.name, worst.scaled_err, worst.tol, "ok" if all(e.ok for e in errs) else "FAIL")
        )
    run_report.add_series(
        Series(
            test=f"probe parity {label}",
            name=f"{impl.name} probe block vs float64, {label}",
            columns=("shape", "N", "r", "worst tensor", "max err / max ref", "tol", "verdict"),
            rows=tuple(rows),
        )
    )
    for v in L.parity_verdicts(label, judged):
        check(v.name, v.value, v.op, v.threshold, source=v.source, detail=v.detail)
    check(
        f"{label}: code path that served the probe's layers",
        ",".join(sorted(served)),
        "==",
        impl.expected_path,
        source="--lora-impl: the implementation says which path ran",
    )


@pytest.mark.parametrize("layout", ["2d", "3d", "noncontig"])
@pytest.mark.parametrize("config", list(DTYPE_CONFIGS))
def test_probe_matches_float64_over_shape_grid(config, layout, lora_impl, check, run_report):
    dtype, adapter_dtype = DTYPE_CONFIGS[config]
    if not _applicable(check, lora_impl, dtype, adapter_dtype):
        return
    cases = [(s, n, R) for s in SHAPES for n in N_TOKENS] + (list(RANK_CASES) if layout == "2d" else [])
    _grid(lora_impl, check, run_report, f"{config} {layout}", dtype, adapter_dtype, cases, layout)


def test_probe_on_a_4bit_base(lora_impl, check, run_report):
    """The LoRA layer over the implementation's own NF4 base (the weights it multiplies with, read back)."""
    why = lora_impl.reason_not_applicable("nf4_base")
    if why:
        check.not_applicable("every check of the probe on a 4-bit base", why)
        return
    # NF4 packs blocks of 64 weights: the odd shape (333 x 1000) has no such layout, the other three do
    cases = [(s, n, R) for s in (SHAPES[0], SHAPES[1], SHAPES[3]) for n in (37, 1024)]
    _grid(
        lora_impl,
        check,
        run_report,
        "bf16 nf4-base 2d",
        BF16,
        F32 if not lora_impl.reason_not_applicable("fp32_adapters_on_16bit_base") else BF16,
        cases,
        "2d",
        quantize="nf4",
    )


def _probe(impl, shape=SHAPES[2], n=37, seed=0):
    adapter_dtype = BF16 if impl.reason_not_applicable("fp32_adapters_on_16bit_base") else F32
    probe = P.build_probe(impl, shape, _spec(impl, adapter_dtype), BF16, DEV, seed=seed)
    return probe, P.random_inputs(shape, (2, n), BF16, DEV, seed=seed + 1)


def _record(check, verdict):
    check(verdict.name, verdict.value, verdict.op, verdict.threshold, source=verdict.source, detail=verdict.detail)


def test_same_input_twice_is_bit_identical(lora_impl, check):
    for shape in (SHAPES[0], SHAPES[2]):
        probe, inputs = _probe(lora_impl, shape)
        _record(check, L.determinism(probe, inputs))


def test_eval_mode_computes_the_same_function(lora_impl, check):
    _record(check, L.eval_mode(*_probe(lora_impl)))


def test_merged_weights_give_the_unmerged_function(lora_impl, check):
    why = lora_impl.merge_reason()
    if why is None and lora_impl.reason_not_applicable("bf16_base"):
        why = f"{lora_impl.name}'s base is always 4-bit: merging re-quantises it (another function by design)"
    if why:
        check.not_applicable("merged weights: outputs within tolerance", why)
        return
    probe, inputs = _probe(lora_impl)
    _record(check, L.merged(probe, inputs))
    _record(check, I.merge_folds(probe, inputs))


def test_captured_replay_equals_eager_bitwise(lora_impl, check):
    why = lora_impl.reason_not_applicable("cuda_graph_capture")
    if why:
        check.not_applicable("captured replay: tensors bitwise equal to eager", why)
        return
    probe, inputs = _probe(lora_impl)
    fresh = P.random_inputs(probe.shape, (2, 37), BF16, DEV, seed=77)
    _record(check, L.captured(probe, inputs, fresh))


def test_gradients_accumulate_and_inputs_without_grad(lora_impl, check):
    _record(check, L.accumulation(*_probe(lora_impl)))
    _record(check, L.no_input_gradient(*_probe(lora_impl)))


def test_nan_stays_in_its_row_side_stream_and_autocast(lora_impl, check):
    _record(check, L.nan_rows(*_probe(lora_impl)))
    _record(check, L.side_stream(*_probe(lora_impl, SHAPES[1], n=512)))
    if lora_impl.reason_not_applicable("bf16_base"):
        check.not_applicable(
            "under autocast: outputs in the autocast dtype",
            f"{lora_impl.name}'s base is always 4-bit: bitsandbytes' Linear4bit computes in its own compute dtype and "
            "returns the input's dtype, by design (an H100 run at a988569: fp32 out under autocast(bf16))",
        )
    elif lora_impl.reason_not_applicable("autocast_fp32_inputs"):
        check.not_applicable(
            "under autocast: outputs in the autocast dtype", lora_impl.reason_not_applicable("autocast_fp32_inputs")
        )
    else:
        _record(check, L.autocast_dtype(*_probe(lora_impl)))
