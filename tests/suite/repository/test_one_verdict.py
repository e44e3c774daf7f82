"""One verdict function (issue 58): a run's PASS / FAIL / NOT JUDGED is decided by ``harness.verdict.run_verdict``
alone. The test searches the two packages for the shape of a second rule (a run's status compared with "complete",
or every check's "passed" folded into one), not for a file name."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HOME = "lora_suite/harness/verdict.py"
# a run-level rule: the report's status read as complete, or the checks' "passed" folded into one boolean
SECOND_RULE = re.compile(r"""status["')\]]*\s*==\s*["']complete["']|all\(\s*\w+\[["']passed["']\]\s+for""")


def second_rules(root: Path) -> list[str]:
    """``file:line`` of every line outside ``HOME`` that holds a second verdict rule (``SECOND_RULE``)."""
    found = []
    for pkg in ("lora_core", "lora_suite"):
        for path in sorted((root / pkg).rglob("*.py")):
            rel = str(path.relative_to(root))
            if rel == HOME:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if SECOND_RULE.search(line):
                    found.append(f"{rel}:{n}")
    return found


def test_the_verdict_is_decided_in_one_place():
    assert second_rules(ROOT) == []


def test_a_second_rule_is_found(tmp_path):
    tools = tmp_path / "lora_suite" / "results"
    tools.mkdir(parents=True)
    (tools / "mine.py").write_text(
        'def ok(r):\n    return r.get("status") == "complete" and all(c["passed"] for c in r["checks"])\n'
    )
    (tmp_path / "lora_core").mkdir()
    assert second_rules(tmp_path) == ["lora_suite/results/mine.py:2"]
