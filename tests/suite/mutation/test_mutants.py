"""The mutants of a source file (``lora_suite.mutation.mutants``, ``lora_suite.mutation.lora_operators``): each LoRA operator
makes its change, cosmic-ray's standard ones run through the same path, docstrings, strings, raise messages and
module-level code are left alone, ids are stable and unique, and a bad source file is named."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("cosmic_ray", reason="the mutate extra (cosmic-ray) is not installed")

from lora_suite.mutation import mutants as MU  # noqa: E402


def _in_function(body: str) -> str:
    return "def f(x, w, a, b, r):\n" + textwrap.indent(textwrap.dedent(body), "    ") + "\n"


def _changed_lines(m: MU.Mutant) -> tuple[list[str], list[str]]:
    lines = m.diff.splitlines()
    minus = [ln[1:].strip() for ln in lines if ln.startswith("-") and not ln.startswith("---")]
    plus = [ln[1:].strip() for ln in lines if ln.startswith("+") and not ln.startswith("+++")]
    return minus, plus


@pytest.mark.parametrize(
    "operator, before, after",
    [
        ("DeleteStatement", "y = x * 2", "pass"),
        ("RemoveTranspose", "y = x @ w.t()", "y = x @ w"),
        ("RemoveTranspose", "y = x @ w.T", "y = x @ w"),
        ("RemoveTranspose", "y = x @ w.transpose(0, 1)", "y = x @ w"),
        ("RemoveDetach", "y = x.detach().clone()", "y = x.clone()"),
        ("InsertDetach", "y = f(x) + g(x)", "y = f(x).detach() + g(x)"),
        ("RemoveCast", "y = a.to(x.dtype)", "y = a"),
        ("RemoveCast", "y = a.float()", "y = a"),
        ("RemoveCast", "y = a.half()", "y = a"),
        ("RemoveCast", "y = a.bfloat16()", "y = a"),
        ("SwapArguments", "y = F.linear(x, a)", "y = F.linear(a, x)"),
        ("SqrtToArgument", "s = a / math.sqrt(r)", "s = a / r"),
        ("ReplaceBinaryOperator_Add_Sub", "y = x + a", "y = x - a"),
        ("ReplaceBinaryOperator_Div_Mul", "s = a / r", "s = a * r"),
        ("ReplaceComparisonOperator_Lt_LtE", "ok = r < 8", "ok = r <= 8"),
        ("NumberReplacer", "y = x * 2", "y = x * 3"),
        ("ReplaceTrueWithFalse", "y = f(x, keep=True)", "y = f(x, keep=False)"),
    ],
)
def test_each_operator_makes_its_change(operator, before, after):
    found = MU.mutants_of(_in_function(before), "snippet.py", (operator,))
    assert found, f"{operator} made no mutant of {before!r}"
    m = found[0]
    assert _changed_lines(m) == ([before], [after])
    assert m.source == _in_function(after)
    compile(m.source, "mutant", "exec")


def test_every_position_of_an_operator_is_one_mutant():
    found = MU.mutants_of(_in_function("y = f(x).t() + g(x).T"), "s.py", ("RemoveTranspose",))
    assert [_changed_lines(m)[1] for m in found] == [["y = f(x) + g(x).T"], ["y = f(x).t() + g(x)"]]
    swaps = MU.mutants_of(_in_function("y = h(x, w, a)"), "s.py", ("SwapArguments",))
    assert [_changed_lines(m)[1] for m in swaps] == [["y = h(w, x, a)"], ["y = h(x, a, w)"]]


SOURCE = '''\
"""A module docstring with 1 + 2 in it."""
import math

SCALE = 2 + 3  # module level: not mutated


class Layer:
    width = 4 * 8  # a class attribute: not mutated

    def forward(self, x):
        """A docstring: 1 + 1 is not code."""
        if x is None:
            raise ValueError(f"x is {x!r}, expected 1 + 2 tensors")
        return x * self.scale + 1
'''


def test_docstrings_raise_messages_and_module_code_are_left_alone():
    found = MU.mutants_of(SOURCE, "layer.py")
    assert found
    changed = {ln for m in found for ln in _changed_lines(m)[0]}
    assert changed <= {
        "if x is None:",
        'raise ValueError(f"x is {x!r}, expected 1 + 2 tensors")',
        "return x * self.scale + 1",
    }, changed
    for m in found:
        assert '"""A docstring: 1 + 1 is not code."""' in m.source
        assert "SCALE = 2 + 3" in m.source and "width = 4 * 8" in m.source
        if "raise" in m.source:  # only whole-statement deletion touches a raise: its message never changes
            assert 'f"x is {x!r}, expected 1 + 2 tensors"' in m.source
    deleted = [m for m in found if m.operator == "DeleteStatement"]
    assert any("            pass\n" in m.source and "raise" not in m.source for m in deleted)


def test_ids_are_stable_unique_and_name_file_operator_line_and_occurrence():
    first, again = MU.mutants_of(SOURCE, "layer.py"), MU.mutants_of(SOURCE, "layer.py")
    assert [m.id for m in first] == [m.id for m in again]
    assert len({m.id for m in first}) == len(first)
    assert len({m.source for m in first}) == len(first)  # no two mutants are the same text
    m = next(m for m in first if m.operator == "ReplaceBinaryOperator_Add_Sub")
    assert m.id == "layer.py:ReplaceBinaryOperator_Add_Sub:14:0"
    assert m.diff.startswith("--- a/layer.py\n+++ b/layer.py\n")


def test_the_example_gets_mutants_of_every_lora_operator_it_can_take():
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    found = MU.mutants_of(MU.read_source(root / "examples" / "plain_lora.py"), "examples/plain_lora.py")
    ops = {m.operator for m in found}
    assert {"DeleteStatement", "RemoveCast", "SwapArguments", "SqrtToArgument", "InsertDetach", "RemoveDetach"} <= ops
    assert all(m.diff and m.line > 0 for m in found)


def test_unknown_operator_is_named():
    with pytest.raises(ValueError, match="unknown mutation operators \\['Nope'\\]"):
        MU.mutants_of(SOURCE, "layer.py", ("Nope",))


def test_a_missing_or_broken_source_is_named(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        MU.read_source(tmp_path / "absent.py")
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    with pytest.raises(ValueError, match=r"bad.py: does not parse as Python \(line 1"):
        MU.read_source(bad)
