"""One shape of the LoRA settings (the issue of the two shapes: ``LoRASettings`` with the dtype as a string,
``AdapterSpec`` with a torch dtype): ``AdapterSpec`` of ``lora_suite/settings/config.py`` is the YAML's lora section
and what an implementation is given. The test searches the two packages' syntax trees for the shape of a second one
(a class that declares a rank, an alpha and another of the LoRA settings' fields), not for a file or a class name."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HOME = ("lora_suite/settings/config.py", "AdapterSpec")
RANK = {"r", "rank", "lora_r", "lora_rank"}
ALPHA = {"alpha", "lora_alpha"}
# the other LoRA settings: with a rank and an alpha, one of these makes a class a second shape of them
# (a drawn test case's r and alpha alone, judges/layer_properties.py's LayerCase, are not)
OTHERS = {"targets", "target_modules", "target_names", "use_rslora", "adapter_dtype", "quantize"}


def _declared(cls: ast.ClassDef) -> set[str]:
    """The names a class body declares as fields (``r: int = 8``)."""
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def second_shapes(root: Path) -> list[str]:
    """``file::Class`` of every class in lora_core/ or lora_suite/ other than ``HOME`` that declares the LoRA
    settings' shape: a rank (``RANK``), an alpha (``ALPHA``) and one more of their fields (``OTHERS``)."""
    found = []
    for pkg in ("lora_core", "lora_suite"):
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if not isinstance(node, ast.ClassDef) or (rel, node.name) == HOME:
                    continue
                names = _declared(node)
                if names & RANK and names & ALPHA and names & OTHERS:
                    found.append(f"{rel}::{node.name}")
    return found


def test_the_lora_settings_have_one_shape():
    assert second_shapes(ROOT) == [], "declare the LoRA settings once: lora_suite/settings/config.py AdapterSpec"


def test_the_one_shape_is_where_it_is_said_to_be():
    tree = ast.parse((ROOT / HOME[0]).read_text())
    (home,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == HOME[1]]
    assert {"targets", "r", "alpha", "use_rslora", "adapter_dtype", "quantize"} <= _declared(home)


def test_a_second_shape_is_found(tmp_path):
    (tmp_path / "lora_core").mkdir()
    tools = tmp_path / "lora_suite" / "engine"
    tools.mkdir(parents=True)
    (tools / "mine.py").write_text(
        "from dataclasses import dataclass\n\n\n"
        "@dataclass\nclass Case:\n    r: int\n    alpha: float\n    seed: int\n\n\n"  # a test case's rank: not a shape
        "class Outer:\n"
        "    @dataclass(frozen=True)\n    class LoraConfig:\n"
        "        target_modules: tuple[str, ...] = ('q_proj',)\n        lora_r: int = 8\n        lora_alpha: float = 16\n"
    )
    assert second_shapes(tmp_path) == ["lora_suite/engine/mine.py::LoraConfig"]
