"""The scorecard's implementation × architecture matrix on the CPU, from quick-tier reports whose records are the
verdicts ``lora_suite.judges.model_function`` gives on the CPU (as ``tiers/quick/test_architectures.py`` records them
on a GPU): lora_core's torch backend (Phi-3 not applicable, with its reason) and the example with its bias dropped
(failing on Qwen2 only)."""

from __future__ import annotations

import json

import torch

from lora_suite.engine.architectures import ARCHITECTURES, NAMES
from lora_suite.implementations import resolve_implementation
from lora_suite.judges import model_function as MF
from lora_suite.results.scorecard import build, main
from lora_suite.scenarios import example_plants as EP


def _report(impl, run: str, names=NAMES) -> dict:
    """A quick run's report.json holding what the architectures test records for ``impl`` on ``names``."""
    checks, na = [], []
    for name in names:
        arch = ARCHITECTURES[name]
        if why := MF.expert_reason(impl, arch):
            na.append({"name": f"{name}: expert parameters adapted", "reason": why})
        if why := MF.not_applicable_reason(impl, arch):
            na.append({"name": f"{name}: every check of this architecture", "reason": why})
            continue
        for v in MF.judge(impl, arch, torch.float32, "cpu"):
            checks.append({"name": v.name, "value": v.value, "op": v.op, "threshold": v.threshold, "passed": v.passed})
    return {
        "run_id": run,
        "status": "complete",
        "selection": "quick",
        "implementation": {"name": impl.name},
        "checks": checks,
        "not_applicable": na,
        "summary": {},
    }


def test_the_matrix_shows_checks_or_the_reason_per_architecture(tmp_path):
    root = tmp_path / "reports"
    for run, impl, names in (
        ("20261127T000000Z-quick-torch", resolve_implementation("torch"), NAMES),
        (
            "20261127T000100Z-quick-plain",
            EP.base_bias_dropped(),
            ("llama", "qwen2", "qwen3_moe"),
        ),  # the CPU's time: three
    ):
        (root / run).mkdir(parents=True)
        (root / run / "report.json").write_text(json.dumps(_report(impl, run, names)))
    card = build([root])
    torch_row, plant_row = card.architectures["torch"], card.architectures["plain-lora"]
    assert set(torch_row) == set(NAMES) and set(plant_row) == {"llama", "qwen2", "qwen3_moe"}
    assert torch_row["phi3"].verdict == "n/a" and "qkv_proj" in torch_row["phi3"].not_applicable[0]
    assert {a: c.verdict for a, c in torch_row.items() if a != "phi3"} == {a: "pass" for a in NAMES if a != "phi3"}
    assert torch_row["qwen2"].judged == 6
    assert torch_row["qwen3_moe"].verdict == "pass" and torch_row["qwen3_moe"].not_applicable == []  # experts too
    moe = plant_row["qwen3_moe"]  # the example adapts no expert: the stack's own reason, not the feature's key
    assert moe.verdict == "pass" and len(moe.not_applicable) == 1 and "moe_experts" not in moe.not_applicable[0]
    assert [a for a, c in plant_row.items() if c.verdict == "fail"] == ["qwen2"]
    assert "qwen2: logits beyond tolerance of the float64 adapted model" in plant_row["qwen2"].failed
    assert main([str(tmp_path / "out"), str(root)]) == 0
    md = (tmp_path / "out" / "scorecard.md").read_text()
    assert f"| implementation | {' | '.join(NAMES)} |" in md
    row = next(line for line in md.splitlines() if line.startswith("| torch | pass, 6 checks"))
    assert "n/a: every check of this architecture: fused_projections: lora_core.inject refuses" in row
    plant_line = next(line for line in md.splitlines() if line.startswith("| plain-lora | pass, 6 checks | fail"))
    assert plant_line.endswith("3-D expert parameters are not linears] |") and "| not run |" in plant_line
    page = (tmp_path / "out" / "scorecard.html").read_text()
    assert "<h2>Architectures (quick tier)</h2>" in page
    saved = json.loads((tmp_path / "out" / "scorecard.json").read_text())["architectures"]
    assert saved["plain-lora"]["qwen2"]["verdict"] == "fail"


def test_a_quick_run_without_the_architecture_tests_has_no_row(tmp_path):
    run = tmp_path / "r" / "20261127T000000Z-quick"
    run.mkdir(parents=True)
    report = {"status": "complete", "selection": "quick", "implementation": {"name": "cupy"}, "summary": {}}
    report["checks"] = [{"name": "fp32 2d: outputs beyond tolerance (of 4)", "value": 0, "op": "==", "threshold": 0}]
    report["checks"][0]["passed"] = True
    (run / "report.json").write_text(json.dumps(report))
    card = build([tmp_path / "r"])
    assert card.architectures == {} and card.matrix["cupy"]["quick"].verdict == "pass"
    assert main([str(tmp_path / "out"), str(tmp_path / "r")]) == 0
    assert "Architectures (quick tier" not in (tmp_path / "out" / "scorecard.md").read_text()
