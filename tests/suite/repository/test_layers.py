"""The layer rule: the system under test imports nothing of its judge, and inside ``lora_suite`` a lower layer
imports nothing of an upper one (every import counts, those inside functions too)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# Bottom up (docs/reports.md, "Layout"): a module may import its own layer and those below it.
LAYERS = (
    "settings",
    "measure",
    "implementations",
    "engine",
    "judges",
    "scenarios",
    "harness",
    "results",
    "mutation",
    "cli",
)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, absolute, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            if node.module == "lora_suite":  # from lora_suite import engine
                out += [(node.lineno, f"lora_suite.{a.name}") for a in node.names]
    return out


def layer_of(module: str) -> str | None:
    """The layer of a ``lora_suite`` module name (``lora_suite.engine.trainer`` -> engine); top-level modules
    (``cli``, ``__main__``) are the command line, the top."""
    parts = module.split(".")
    if parts[0] != "lora_suite" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else "cli"


def violations(package_dir: Path) -> list[str]:
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir.parent).with_suffix("")
        if "tiers" in rel.parts or "benchmarks" in rel.parts:
            continue  # shipped test modules: they sit on top of everything
        mine = layer_of(".".join(p for p in rel.parts if p != "__init__"))
        for line, module in imported_modules(path):
            theirs = layer_of(module)
            if mine and theirs and LAYERS.index(theirs) > LAYERS.index(mine):
                found.append(f"{rel}.py:{line}: {mine} imports {module} ({theirs}, a layer above)")
    return found


def test_every_lora_suite_module_lives_in_a_known_layer():
    pkg = ROOT / "lora_suite"
    strays = [p.name for p in pkg.glob("*.py") if p.stem not in ("__init__", "__main__", "cli")]
    dirs = sorted(d.name for d in pkg.iterdir() if d.is_dir() and (d / "__init__.py").exists())
    assert not strays, f"modules outside the layers: {strays}"
    assert set(dirs) <= set(LAYERS), f"packages that are not layers: {sorted(set(dirs) - set(LAYERS))}"


def test_no_lower_layer_imports_an_upper_one():
    assert violations(ROOT / "lora_suite") == []


def test_the_rule_catches_an_upward_import(tmp_path):
    pkg = tmp_path / "lora_suite"
    (pkg / "measure").mkdir(parents=True)
    (pkg / "measure" / "timing.py").write_text("def f():\n    from lora_suite.engine.trainer import train\n")
    assert violations(pkg) == [
        "lora_suite/measure/timing.py:2: measure imports lora_suite.engine.trainer (engine, a layer above)"
    ]


# The soft cap on a module's lines: past it, a module is split by concept, one concept per file named for what it
# holds (docs/architecture.md maps which module holds what).
# Tier and benchmark test modules (lora_suite/tiers/**/test_*.py, lora_suite/benchmarks/test_*.py) are left out:
# each holds one tier's or one benchmark's tests, which read best together.
SOFT_CAP = 350


def is_tier_or_benchmark_test(rel: Path) -> bool:
    """``rel`` (relative to the repository root) is ``lora_suite/tiers/**/test_*.py`` or
    ``lora_suite/benchmarks/test_*.py``."""
    if not (rel.name.startswith("test_") and rel.suffix == ".py"):
        return False
    return rel.parts[:2] == ("lora_suite", "tiers") or rel.parent == Path("lora_suite", "benchmarks")


def long_modules(root: Path, limit: int = SOFT_CAP) -> dict[str, int]:
    """Each module of ``lora_core`` and ``lora_suite`` under ``root`` over ``limit`` lines -> its lines, the tier and
    benchmark test modules aside."""
    return {
        rel.as_posix(): n
        for pkg in ("lora_core", "lora_suite")
        for p in sorted((root / pkg).rglob("*.py"))
        if not is_tier_or_benchmark_test(rel := p.relative_to(root)) and (n := len(p.read_text().splitlines())) > limit
    }


def test_no_module_of_the_two_packages_is_over_the_soft_cap():
    long = long_modules(ROOT)
    assert long == {}, (
        f"split these by concept, one concept per file named for what it holds (at most {SOFT_CAP} lines a module; "
        f"docs/architecture.md maps which module holds what): {long}"
    )


def test_the_soft_cap_catches_a_long_module_and_leaves_tier_and_benchmark_tests_alone(tmp_path):
    lines = {
        "lora_suite/engine/long.py": SOFT_CAP + 1,
        "lora_suite/engine/short.py": SOFT_CAP,
        "lora_core/ops/long_op.py": SOFT_CAP + 1,
        "lora_suite/tiers/quick/test_long_tier.py": SOFT_CAP + 1,
        "lora_suite/benchmarks/test_long_bench.py": SOFT_CAP + 1,
        "lora_suite/benchmarks/long_helper.py": SOFT_CAP + 1,  # a benchmark's helper is no test module
        "lora_suite/tiers/quick/tier_helper.py": SOFT_CAP + 1,
    }
    for rel, n in lines.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n" * n)
    assert long_modules(tmp_path) == {
        "lora_core/ops/long_op.py": SOFT_CAP + 1,
        "lora_suite/benchmarks/long_helper.py": SOFT_CAP + 1,
        "lora_suite/engine/long.py": SOFT_CAP + 1,
        "lora_suite/tiers/quick/tier_helper.py": SOFT_CAP + 1,
    }
