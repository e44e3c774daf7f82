"""``docs/lora-spec.md`` and the checks stay in step: every check its table names exists in the code (a check's name
template, read from the source: literal text with ``{…}`` for what it formats), every check of the layer, round-trip
and smoke tests has a row, every cited defect report maps to an invariant of the table, and every planted defect of
the example names a check of the table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from lora_suite.scenarios.example_plants import PLANTS

ROOT = Path(__file__).resolve().parents[3]
SPEC = ROOT / "docs" / "lora-spec.md"
# The modules whose every check must have a row: the layer and round-trip checks and the quick tests that record them
# (the table also names checks of the smoke run and the longer tiers; those need only exist).
COVERED = (
    "lora_suite/judges/layer_checks.py",
    "lora_suite/judges/invariant_checks.py",
    "lora_suite/judges/round_trip.py",
    "lora_suite/judges/peft_folder.py",
    "lora_suite/judges/broken_folders.py",
    "lora_suite/tiers/quick/test_layer_probes.py",
    "lora_suite/tiers/quick/test_layer_invariants.py",
    "lora_suite/tiers/quick/test_adapter_round_trip.py",
    "lora_suite/judges/layer_properties.py",
    "lora_suite/judges/merge_rounding.py",
    "lora_suite/judges/non_finite_checks.py",
    "lora_suite/judges/two_models.py",
    "lora_suite/judges/name_collisions.py",
    "lora_suite/tiers/quick/test_layer_properties.py",
    "lora_suite/judges/adapter_options.py",
    "lora_suite/judges/combined_adapters.py",
    "lora_suite/judges/expert_adapters.py",
    "lora_suite/judges/stack_reference.py",
    "lora_suite/tiers/quick/test_adapter_options.py",
)
REPOSITORIES = {
    "huggingface/peft",
    "unslothai/unsloth",
    "axolotl-ai-cloud/axolotl",
    "OpenAccess-AI-Collective/axolotl",
    "pytorch/torchtune",
    "meta-pytorch/torchtune",
    "bitsandbytes-foundation/bitsandbytes",
    "TimDettmers/bitsandbytes",
    "linkedin/Liger-Kernel",
}


def _is_check_call(func: ast.expr) -> bool:
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return name in ("Verdict", "none_of", "check", "not_applicable")


def _template(node: ast.expr) -> str | None:
    """A check name's template: its literal text, ``{}`` for each formatted value (None: not a literal name)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def check_templates(path: Path) -> list[str]:
    """The name templates of every check a module records or returns (``Verdict(name, …)``, ``none_of(name, …)``,
    ``check(name, …)``, ``check.not_applicable(name, …)``) whose name is written there."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and _is_check_call(node.func) and node.args:
            t = _template(node.args[0])
            if t and t.replace("{}", "").strip(" :"):
                out.append(t)
    return list(dict.fromkeys(out))


def _pattern(template: str) -> re.Pattern:
    return re.compile(".+?".join(re.escape(part) for part in template.split("{}")))


def _literal(template: str) -> int:
    return len(template.replace("{}", ""))


def best_template(name: str, templates: list[str]) -> str | None:
    """The most specific template (most literal text) whose pattern the whole name matches."""
    matches = [t for t in templates if _pattern(t).fullmatch(name)]
    return max(matches, key=_literal) if matches else None


def _table(text: str, header: str) -> list[list[str]]:
    """The rows of the Markdown table whose header row starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))  # a name's own pipes are written \|
        rows.append([c.strip().replace("\\|", "|") for c in cells])
    return rows


def spec_rows(text: str) -> list[dict]:
    out = []
    for cells in _table(text, "| ID |"):
        ident, invariant, sources, checks, tier, cost, feature = cells
        out.append(
            {"id": ident, "checks": re.findall(r"`([^`]+)`", checks), "tier": tier, "cost": cost, "feature": feature}
        )
    return out


def defect_rows(text: str) -> list[dict]:
    out = []
    for cells in _table(text, "| # | repository |"):
        _, repo, report, _what, invariant = cells[:5]
        link = re.fullmatch(
            r"\[(?P<name>[^#\]]+)#(?P<n>[0-9]+)\]\(https://github\.com/(?P<url>[^)]+)/(issues|pull)/(?P=n)\)", report
        )
        out.append(
            {
                "repo": repo.strip("`"),
                "number": link["n"] if link else report,
                "linked": (link["name"], link["url"]) if link else None,
                "invariant": invariant,
            }
        )
    return out


@pytest.fixture(scope="module")
def text() -> str:
    return SPEC.read_text()


def _all_templates() -> list[str]:
    return [t for p in sorted((ROOT / "lora_suite").rglob("*.py")) for t in check_templates(p)]


def test_every_check_the_table_names_exists(text):
    templates = _all_templates()
    names = [n for row in spec_rows(text) for n in row["checks"]]
    assert len(names) >= 30
    missing = [n for n in names if best_template(n, templates) is None]
    assert missing == [], f"rows name checks no module records: {missing}"


def test_every_check_of_the_layer_and_round_trip_tests_has_a_row(text):
    covered = [t for rel in COVERED for t in check_templates(ROOT / rel)]
    templates = _all_templates()
    named = {best_template(n, templates) for row in spec_rows(text) for n in row["checks"]}
    without = [t for t in covered if t not in named]
    assert without == [], f"checks without a row in docs/lora-spec.md: {without}"


def test_rows_name_a_tier_a_cost_and_a_declarable_feature(text):
    from lora_suite.implementations.contract import FEATURES

    rows = spec_rows(text)
    assert len({r["id"] for r in rows}) == len(rows), "IDs repeat"
    for r in rows:
        assert r["tier"] in ("quick", "convergence", "memory", "extended", "full"), r
        assert re.fullmatch(r"[0-9.]+|-", r["cost"]), r
        assert r["feature"] in ("-", *(f"`{f}`" for f in FEATURES)), r


def test_at_least_twenty_cited_defect_reports_each_mapped_to_an_invariant(text):
    ids = {r["id"] for r in spec_rows(text)}
    reports = defect_rows(text)
    assert len(reports) >= 20
    assert len({(r["repo"], r["number"]) for r in reports}) == len(reports), "a report is cited twice"
    for r in reports:
        assert r["repo"] in REPOSITORIES, r
        assert r["number"].isdigit() and r["linked"] == (r["repo"], r["repo"]), r
        assert r["invariant"] in ids, r
    assert len({r["repo"].split("/")[1].lower() for r in reports}) >= 5


def test_every_planted_defect_names_a_check_of_the_table(text):
    names = [n for row in spec_rows(text) for n in row["checks"]]
    unnamed = [d for d, (_, _, fragment) in PLANTS.items() if not fragment or not any(fragment in n for n in names)]
    assert unnamed == []


def test_the_matcher_tells_a_check_that_does_not_exist():
    templates = ["{}: {} beyond tolerance (of {})", "eval mode: outputs beyond tolerance (of {})"]
    assert best_template("eval mode: outputs beyond tolerance (of N)", templates) == templates[1]
    assert best_template("fp32 2d: dA beyond tolerance (of N)", templates) == templates[0]
    assert best_template("adapters never saved", templates) is None
    assert check_templates(Path(__file__)) == []  # this module records no check
