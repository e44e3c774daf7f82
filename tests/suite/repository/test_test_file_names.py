"""Test files are collected by basename (rootdir-relative imports, no packages): two test files of one name anywhere in
the collected trees stop `pytest -m quick` at collection with "import file mismatch" (issue 8's exit 2). The check
runs here in a second, before the README-command tests that would otherwise find it after minutes."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TREES = ("tests", "lora_suite")


def files_sharing_a_name(roots=TREES, base: Path = ROOT) -> dict[str, list[str]]:
    """Each test file's basename that more than one test file under ``roots`` has, with the files."""
    seen: dict[str, list[str]] = defaultdict(list)
    for d in roots:
        for p in (base / d).rglob("test_*.py"):
            seen[p.name].append(str(p.relative_to(base)))
    return {name: sorted(paths) for name, paths in seen.items() if len(paths) > 1}


def test_every_test_file_name_is_used_once():
    assert files_sharing_a_name() == {}


def test_a_second_file_of_one_name_is_named(tmp_path):
    for d in ("tests/core", "lora_suite/tiers/quick"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "test_x.py").write_text("")
    assert files_sharing_a_name(base=tmp_path) == {
        "test_x.py": ["lora_suite/tiers/quick/test_x.py", "tests/core/test_x.py"]
    }
