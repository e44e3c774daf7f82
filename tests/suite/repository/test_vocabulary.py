"""The project speaks as itself (issue 33): no word of the place it was built in, no path outside the repository.

Every tracked file but the ledger (whose rows keep the reasons as the runs recorded them) is read; a hit names the
file, the line and the words."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
L, S = "le" + "nt", "sha" + "red"  # spelled apart so that this file does not match itself
FORBIDDEN = re.compile(
    rf"{L} (gpu|h1|h2)|the {L}|\b{L} (machine|h100|h200)|{S}/GPU_NOTES|\.\./{S}/|{S}/evidence|device" + " call",
    re.IGNORECASE,
)
EXCLUDED = {"reports/ledger.jsonl.gz"}
SKIP_DIRS = {".git", ".venv", "reports", "build", "dist", ".whl", "__pycache__", ".pytest_cache", ".ruff_cache"}


def _files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        return out.stdout.splitlines()
    # a copy without .git: every file under the root but build outputs and caches
    return [
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*")
        if p.is_file() and not SKIP_DIRS & set(p.relative_to(ROOT).parts[:-1])
    ] + [str(p.relative_to(ROOT)) for p in (ROOT / "reports").glob("*.md")]


def hits(paths: list[str], root: Path = ROOT) -> list[str]:
    found = []
    for rel in paths:
        if rel in EXCLUDED:
            continue
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary (plots, gzipped fixtures)
        for n, line in enumerate(text.splitlines(), 1):
            m = FORBIDDEN.search(line)
            if m:
                found.append(f"{rel}:{n}: {m.group(0)!r}")
    return found


def test_no_tracked_file_speaks_of_borrowed_machines_or_files_outside_the_repository():
    files = _files()
    assert len(files) > 100, files[:5]
    assert hits(files) == []


def test_the_check_finds_each_kind_of_word(tmp_path):
    (tmp_path / "a.md").write_text(f"ran on the {L} H200\nsee ../{S}/GPU_NOTES.md\nfine: an H200, the GPU runner\n")
    (tmp_path / "b.py").write_text("# as one device" + " call could carry\n")
    assert hits(["a.md", "b.py"], tmp_path) == [
        f"a.md:1: 'the {L}'",
        f"a.md:2: '../{S}/'",
        "b.py:1: 'device" + " call'",
    ]
