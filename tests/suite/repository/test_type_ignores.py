"""Every silenced type error says what and why (issue 46): each ``# type: ignore`` under ``lora_core/`` and
``lora_suite/`` names its mypy error code(s) in brackets and carries a reason in a comment after it on the same
line (``# type: ignore[attr-defined]  # pytest-benchmark is untyped: ...``), and each ``[[tool.mypy.overrides]]``
block of pyproject.toml has a comment line directly above it saying why that library is let off.

A bare ``# type: ignore`` hides every error of its line, today's and those a later change brings; a code without a
reason leaves the next reader to guess whether it still holds."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("lora_core", "lora_suite")
OVERRIDES = "[[tool.mypy.overrides]]"

IGNORE = re.compile(r"#\s*type:\s*ignore\b")  # mypy's marker, anywhere in a comment
# the marker, its codes (lower-case words with dashes, comma-separated, in brackets), then "# reason" (not empty)
WELL_FORMED = re.compile(r"#\s*type:\s*ignore\[[a-z][a-z0-9-]*(?:,\s*[a-z][a-z0-9-]*)*\]\s+#\s*\S")


def python_files() -> list[Path]:
    """Every .py under the packages, their tests included."""
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def bad_ignores(path: Path) -> list[str]:
    """``path:line: comment`` for each ``# type: ignore`` comment of ``path`` that lacks its code in brackets or a
    reason after it. Comments only (tokenize): the marker inside a string is not an ignore."""
    bad = []
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    for tok in tokens:
        if tok.type != tokenize.COMMENT or not IGNORE.search(tok.string):
            continue
        marker = IGNORE.search(tok.string)
        assert marker is not None  # searched just above
        if not WELL_FORMED.match(tok.string, marker.start()):
            bad.append(f"{path}:{tok.start[0]}: {tok.string}")
    return bad


def bare_overrides(text: str) -> list[int]:
    """The line numbers (1-based) of the ``[[tool.mypy.overrides]]`` headers of a pyproject ``text`` whose line
    directly above is not a comment."""
    lines = text.splitlines()
    return [
        n + 1
        for n, line in enumerate(lines)
        if line.strip() == OVERRIDES and (n == 0 or not lines[n - 1].lstrip().startswith("#"))
    ]


def test_every_type_ignore_names_its_code_and_reason():
    bad = [line.removeprefix(f"{ROOT}/") for path in python_files() for line in bad_ignores(path)]
    assert not bad, (
        f"{len(bad)} '# type: ignore' without an error code in brackets or a reason comment after it on the same "
        "line (expected '# type: ignore[code]  # why'):\n" + "\n".join(bad)
    )


def test_every_mypy_override_says_why():
    bare = bare_overrides((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert not bare, f"pyproject.toml: {OVERRIDES} at line(s) {bare} with no comment line directly above (why)"


def test_the_rules_catch_bad_lines(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        "a = f()  # type: ignore[attr-defined]  # the library is untyped\n"  # good
        "b = f()  # type: ignore[arg-type, union-attr]  # two codes, one reason\n"  # good
        'c = "# type: ignore"\n'  # good: a string, not a comment
        "d = f()  # type: ignore\n"  # bad: no code, no reason
        "e = f()  # type: ignore[attr-defined]\n"  # bad: no reason
        "g = f()  # type: ignore  # a reason but no code\n"  # bad: no code
        "h = f()  # type: ignore[]  # empty brackets\n"  # bad: no code
        "i = f()  # type: ignore[attr-defined]  #\n",  # bad: an empty reason
        encoding="utf-8",
    )
    assert [int(line.split(":")[1]) for line in bad_ignores(source)] == [4, 5, 6, 7, 8]
    toml = (
        "[tool.mypy]\n"
        "# why the first is let off\n"
        f"{OVERRIDES}\n"
        'module = ["a"]\n'
        "ignore_missing_imports = true\n"
        "\n"
        f"{OVERRIDES}\n"
        'module = ["b"]\n'
    )
    assert bare_overrides(toml) == [7]
    assert bare_overrides(f"{OVERRIDES}\n") == [1]
