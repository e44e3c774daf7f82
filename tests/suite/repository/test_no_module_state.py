"""State has an owner (docs/architecture.md): no module of ``lora_suite/harness/`` keeps a run's state in a
module-level container; per-run state lives on an object (a plugin instance, a typed stash key), a per-process cache
on a function (``functools.cache``). The rule, read from each module's syntax tree:

- a module-level name bound to a mutable container (a ``{}``, ``[]`` or set display, a comprehension, a call of
  ``dict``, ``list``, ``set``, ``defaultdict``, ``OrderedDict``, ``Counter``, ``deque`` or ``bytearray``) is state,
  unless it is an ALL_CAPS constant that no module of ``lora_suite`` mutates: stores or deletes an item of it, adds to
  it in place (``+=``), or calls a mutating method on it (``append``, ``update``, ``setdefault``, ``pop``, ...), by its
  name or as ``module.NAME``;
- a ``global`` statement is state: a function rebinds a module-level name.

What a syntax tree cannot see, the rule does not catch: a constant handed to a function that mutates its argument."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MUTABLE_CALLS = frozenset({"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "bytearray"})
MUTATORS = frozenset(
    {
        "append",
        "extend",
        "insert",
        "pop",
        "popitem",
        "remove",
        "clear",
        "update",
        "setdefault",
        "add",
        "discard",
        "sort",
        "reverse",
        "appendleft",
        "extendleft",
        "popleft",
        "difference_update",
        "intersection_update",
        "symmetric_difference_update",
        "__setitem__",
        "__delitem__",
    }
)
DISPLAYS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


def _name(node: ast.AST) -> str | None:
    """``NAME`` of ``NAME`` or ``anything.NAME``."""
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def _is_mutable(value: ast.expr | None) -> bool:
    if isinstance(value, DISPLAYS):
        return True
    return isinstance(value, ast.Call) and _name(value.func) in MUTABLE_CALLS


def module_containers(tree: ast.Module) -> dict[str, int]:
    """Name -> line of each module-level binding of a mutable container (inside module-level ``if``/``try`` too)."""
    found: dict[str, int] = {}
    statements: list[ast.stmt] = list(tree.body)
    while statements:
        node = statements.pop(0)
        if isinstance(node, (ast.If, ast.Try)):
            statements += node.body + node.orelse + getattr(node, "finalbody", [])
            statements += [s for handler in getattr(node, "handlers", []) for s in handler.body]
        elif isinstance(node, ast.Assign) and _is_mutable(node.value):
            found |= {t.id: node.lineno for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and _is_mutable(node.value) and isinstance(node.target, ast.Name):
            found[node.target.id] = node.lineno
    return found


def mutated_names(tree: ast.AST) -> set[str]:
    """The names (``NAME`` or ``x.NAME``) this tree mutates in place: an item stored or deleted, ``+=``, a mutating
    method called."""
    out: set[str | None] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(_name(node.value))
        elif isinstance(node, ast.AugAssign):
            out.add(_name(node.target))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            out.add(_name(node.func.value))
    return {n for n in out if n}


def violations(package: Path, scope: Path) -> list[str]:
    """Module-level state in the modules under ``package``; mutations are looked for in every module under ``scope``."""
    mutated: set[str] = set()
    for path in sorted(scope.rglob("*.py")):
        mutated |= mutated_names(ast.parse(path.read_text(), str(path)))
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(scope.parent)
        for name, line in sorted(module_containers(tree).items(), key=lambda item: item[1]):
            if not name.isupper():
                found.append(f"{rel}:{line}: {name}: a module-level mutable container (state: keep it on an object)")
            elif name in mutated:
                found.append(f"{rel}:{line}: {name}: a module-level container that code mutates (state: on an object)")
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found.append(f"{rel}:{node.lineno}: global {', '.join(node.names)} (state: keep it on an object)")
    return found


def test_no_harness_module_keeps_state_in_a_module_level_container():
    assert violations(ROOT / "lora_suite" / "harness", ROOT / "lora_suite") == []


def test_the_rule_catches_a_run_dict_that_a_hook_fills(tmp_path):
    harness = tmp_path / "lora_suite" / "harness"
    harness.mkdir(parents=True)
    (harness / "state.py").write_text("RUN: dict[str, object] = {}\nWORDS = {'PASS': 'pass'}\n_seen = set()\n")
    (harness / "hooks.py").write_text(
        textwrap.dedent("""
            from lora_suite.harness import state
            from lora_suite.harness.state import WORDS
            _cache = None

            def pytest_sessionstart(session):
                state.RUN["start"] = 1.0
                return WORDS["PASS"]

            def cached():
                global _cache
                _cache = _cache or 1
        """)
    )
    assert violations(harness, tmp_path / "lora_suite") == [
        "lora_suite/harness/hooks.py:11: global _cache (state: keep it on an object)",
        "lora_suite/harness/state.py:1: RUN: a module-level container that code mutates (state: on an object)",
        "lora_suite/harness/state.py:3: _seen: a module-level mutable container (state: keep it on an object)",
    ]
