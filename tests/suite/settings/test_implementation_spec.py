"""The implementation spec (issue 58): one parser (``implementation_names.parse_spec``) for the command line, a tier
YAML and the lookup; one list of the built-ins, held to the lookup's factories; the bundled peers held to the entry
points pyproject.toml declares; and a repository check that no second pattern of the spec appears."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

from lora_suite.settings.implementation_names import (
    BUILTINS,
    BUNDLED,
    ENTRY_POINT_GROUP,
    ImplementationSpec,
    SpecError,
    parse_spec,
)

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "text,want",
    [
        ("cupy", ImplementationSpec("cupy")),
        ("cupy-fused", ImplementationSpec("cupy-fused")),
        ("my_org.lora-v2", ImplementationSpec("my_org.lora-v2")),  # an entry point's name may hold dashes and dots
        ("pkg.mod:make", ImplementationSpec("pkg.mod:make", "pkg.mod", "make")),
        ("mod:Factory_2", ImplementationSpec("mod:Factory_2", "mod", "Factory_2")),
    ],
)
def test_names_and_module_factories_parse(text, want):
    got = parse_spec(text)
    assert got == want and got.is_module == (want.module is not None)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("", "expected a name"),
        ("  ", "expected a name"),
        (None, "expected a name"),
        (3, "expected a name"),
        ("a b", "expected a name"),
        ("-cupy", "expected a name"),
        ("pkg.mod:", "expected package.module:factory"),
        (":make", "expected package.module:factory"),
        ("my-pkg.mod:make", "expected package.module:factory"),  # a module path has no dashes
        ("pkg.mod:make:more", "expected package.module:factory"),
        ("../evil:x", "expected package.module:factory"),
    ],
)
def test_anything_else_is_refused_naming_the_value(text, expected):
    with pytest.raises(SpecError, match=re.escape(f"LoRA implementation {text!r}: {expected}")):
        parse_spec(text)


def test_the_builtins_are_the_lookups_factories():
    from lora_suite.implementations.lookup import BUILTIN_FACTORIES

    assert tuple(BUILTIN_FACTORIES) == BUILTINS


def test_the_bundled_peers_are_the_entry_points_pyproject_declares():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][ENTRY_POINT_GROUP]
    assert declared == BUNDLED


# A regular expression of the spec: a literal pattern holding ":" followed by a Python-name class, the shape of
# package.module:factory (a name pattern alone is not the spec: many names are matched for other reasons)
SPEC_PATTERN = re.compile(r"""r["'][^"'\n]*:\[A-Za-z_\]""")


def spec_patterns(root: Path) -> list[str]:
    """Every ``file:line`` under ``root``'s two packages whose source holds a spec pattern (``SPEC_PATTERN``)."""
    found = []
    for pkg in ("lora_core", "lora_suite"):
        for path in sorted((root / pkg).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if SPEC_PATTERN.search(line):
                    found.append(f"{path.relative_to(root)}:{n}")
    return found


def test_the_spec_has_one_pattern_in_one_place():
    found = spec_patterns(ROOT)
    assert [f.rsplit(":", 1)[0] for f in found] == ["lora_suite/settings/implementation_names.py"], found


def test_a_second_spec_pattern_is_found(tmp_path):
    pkg = tmp_path / "lora_suite" / "cli"
    pkg.mkdir(parents=True)
    (pkg / "extra.py").write_text('import re\nSPEC = re.compile(r"[a-z]+(:[A-Za-z_]\\w*)?")\n')
    (tmp_path / "lora_core").mkdir()
    assert spec_patterns(tmp_path) == ["lora_suite/cli/extra.py:2"]
