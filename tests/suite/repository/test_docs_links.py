"""The README guides and docs/ holds the reference (issue 33): the README stays at most 12 KB, and every relative
link in it, in docs/ and in the reports' README resolves to a file of the repository."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PAGES = ["README.md", "reports/README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def broken_links(page: Path) -> list[str]:
    out = []
    for n, line in enumerate(page.read_text().splitlines(), 1):
        for url in LINK.findall(line):
            if re.match(r"[a-z]+:", url) or url.startswith("#"):
                continue  # a web address or an anchor on the same page
            target = (page.parent / url.split("#")[0]).resolve()
            if not target.exists():
                out.append(f"{page.relative_to(ROOT)}:{n}: {url}")
    return out


def test_the_readme_is_a_guide_of_at_most_12_kb():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 12 * 1024, len(text.encode())
    first_screen = text[:2500]
    assert "./scripts/gpu-test.sh quick" in first_screen and "./scripts/gpu-test.sh selftest" in first_screen


def test_every_relative_link_resolves():
    assert len(PAGES) >= 8, PAGES
    assert [b for p in PAGES for b in broken_links(ROOT / p)] == []


def test_a_broken_link_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("see [b](b.md), [readme](../README.md) and [web](https://x.org)\n")
    (tmp_path / "docs" / "b.md").write_text("")
    assert broken_links(tmp_path / "docs" / "a.md") == ["docs/a.md:1: ../README.md"]
