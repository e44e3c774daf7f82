"""Every path of the repository that README.md and docs/ name in code (`lora_suite/cli/preflight.py`,
`tests/suite/`, `scripts/gpu-test.sh`) exists (issue 46): a file moved or renamed cannot leave a page pointing
nowhere. Placeholders (`<tier>`, `*`) and run-time outputs (`reports/<run-id>/`, `reports/results.sqlite`) are not
paths of the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
TOPS = ("lora_core/", "lora_suite/", "tests/", "scripts/", "docs/", "examples/", "configs/", "tiers/", "benchmarks/",
        ".github/", ".ci/", "reports/")  # fmt: skip
PATH = re.compile(r"`((?:" + "|".join(re.escape(t) for t in TOPS) + r")[^`\s:]*)")
OUTPUTS = ("reports/results.sqlite", "reports/nightly", "reports/history", "reports/tonight", "reports/_local",
           "reports/ci", "reports/nights.jsonl")  # fmt: skip


def named_paths(text: str) -> list[str]:
    out = []
    for path in PATH.findall(text):
        path = path.rstrip(".,;)")
        if any(c in path for c in "<>*{}$") or path.startswith(OUTPUTS):
            continue
        out.append(path)
    return out


def missing(page: str) -> list[str]:
    return [f"{page}: {p}" for p in named_paths((ROOT / page).read_text()) if not (ROOT / p).exists()]


def test_every_path_the_docs_name_exists():
    assert len(PAGES) >= 10
    assert [m for page in PAGES for m in missing(page)] == []


def test_a_path_that_does_not_exist_is_named(tmp_path):
    text = "see `lora_suite/nowhere.py` and `lora_suite/cli/preflight.py` and `lora_suite/tiers/<tier>/`"
    paths = named_paths(text)
    assert paths == ["lora_suite/nowhere.py", "lora_suite/cli/preflight.py"]
    assert [p for p in paths if not (ROOT / p).exists()] == ["lora_suite/nowhere.py"]
