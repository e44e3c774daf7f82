"""The mutants of a source file: cosmic-ray's standard operators (a chosen set, below) and the LoRA operators of
``lora_operators`` and ``lora_value_operators``, applied one at a time to the code inside functions and methods.

cosmic-ray 8.7 is used as a library: its operators and its parso helpers (``cosmic_ray.operators``,
``cosmic_ray.ast``) import parso and attrs only; its runner (``cosmic_ray.mutating``, sessions in SQLite, stevedore
plugins) is not used. Each operator enumerates its positions over the parso tree in cosmic-ray's walk order; the
n-th position is mutated by walking a fresh tree to it (as ``cosmic_ray.mutating.MutationVisitor`` does).

What is left alone: code outside functions (imports, class attributes, module constants: the stack's description,
not its behaviour), docstrings and every string, and whatever is inside a ``raise`` statement (its message; the
statement itself can still be deleted). A mutant that does not compile, or whose text equals the source's or an
earlier mutant's, is dropped.

A mutant's id is ``<file>:<operator>:<line>:<n>``, n counting that operator's positions on that line from 0: it stays
the same as long as the file does.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

EXTRA_HINT = "pip install 'lora-gpu-suite[mutate]' (cosmic-ray 8.7, parso, attrs)"

# cosmic-ray's standard operators run here (class names of cosmic_ray.operators.provider). Each binary and comparison
# operator gets its nearest replacements only (Add->Sub, Lt->LtE, ...), not every one of cosmic-ray's 11 and 7:
# a LoRA file's few arithmetic lines would otherwise give most of the mutants and the run would take 5x as long.
STANDARD = (
    "ReplaceBinaryOperator_Add_Sub",
    "ReplaceBinaryOperator_Sub_Add",
    "ReplaceBinaryOperator_Mul_Div",
    "ReplaceBinaryOperator_Div_Mul",
    "ReplaceBinaryOperator_FloorDiv_Div",
    "ReplaceBinaryOperator_Pow_Mul",
    "ReplaceBinaryOperator_Mod_FloorDiv",
    "ReplaceComparisonOperator_Eq_NotEq",
    "ReplaceComparisonOperator_NotEq_Eq",
    "ReplaceComparisonOperator_Lt_LtE",
    "ReplaceComparisonOperator_LtE_Lt",
    "ReplaceComparisonOperator_Gt_GtE",
    "ReplaceComparisonOperator_GtE_Gt",
    "ReplaceComparisonOperator_Is_IsNot",
    "ReplaceComparisonOperator_IsNot_Is",
    "ReplaceUnaryOperator_USub_UAdd",
    "ReplaceUnaryOperator_Delete_Not",
    "AddNot",
    "ReplaceTrueWithFalse",
    "ReplaceFalseWithTrue",
    "ReplaceAndWithOr",
    "ReplaceOrWithAnd",
    "ReplaceBreakWithContinue",
    "ReplaceContinueWithBreak",
    "NumberReplacer",
    "ZeroIterationForLoop",
)


class MutateUnavailable(RuntimeError):
    """The ``mutate`` extra (cosmic-ray and parso) is not installed."""


@dataclass(frozen=True)
class Mutant:
    file: str  # the source file as it was named (its path relative to the working folder where it lies under it)
    operator: str
    line: int
    occurrence: int  # this operator's positions on this line, from 0
    source: str  # the mutated file
    diff: str  # unified diff against the original

    @property
    def id(self) -> str:
        return f"{self.file}:{self.operator}:{self.line}:{self.occurrence}"


def operators() -> dict[str, type]:
    """Operator name -> class: ``STANDARD`` from cosmic-ray, then the LoRA operators (syntactic, then the value
    classes of ``lora_value_operators``)."""
    try:
        from cosmic_ray.operators.provider import OperatorProvider

        from lora_suite.mutation import lora_operators, lora_value_operators
    except ImportError as exc:
        raise MutateUnavailable(f"mutation testing needs the mutate extra ({exc}): {EXTRA_HINT}") from None
    provider = OperatorProvider()
    out = {name: provider[name] for name in STANDARD}
    out.update({cls.__name__: cls for cls in lora_operators.LORA_OPERATORS})
    out.update({cls.__name__: cls for cls in lora_value_operators.VALUE_OPERATORS})
    return out


def fingerprint_blind(name: str, parts=()) -> str:
    """Why the fingerprint cannot show a mutant of operator ``name`` equivalent (its class lies outside what the
    fingerprint runs: ``FINGERPRINT_BLIND`` of ``lora_value_operators``); empty where it can, or where one of the
    fingerprint's ``parts`` (labels ``configuration: part``) comes from the configuration the operator names in
    ``FINGERPRINT_SEEN_IN`` (DropBias: a probe with biases)."""
    op = operators().get(name)
    seen_in = getattr(op, "FINGERPRINT_SEEN_IN", None)
    if seen_in and any(seen_in in label.split(":", 1)[0] for label in parts):
        return ""
    return getattr(op, "FINGERPRINT_BLIND", "")


def _inside_function(node) -> bool:
    return node.search_ancestor("funcdef") is not None


def _left_alone(node) -> bool:
    """Strings (docstrings, messages, f-strings and what they hold) and the inside of a ``raise`` statement."""
    if node.type in ("string", "strings", "fstring"):
        return True
    return node.search_ancestor("raise_stmt", "fstring", "strings") is not None


def _walk(node):
    """Every node, parent before children (cosmic-ray's order)."""
    yield node
    for child in getattr(node, "children", ()):
        yield from _walk(child)


def positions(source: str, operator) -> list[tuple[int, int, bool]]:
    """(occurrence over the whole file, line, mutable here) of every position ``operator`` has in ``source``."""
    import parso

    out, k = [], 0
    for node in _walk(parso.parse(source)):
        for (line, _col), _end in operator.mutation_positions(node):
            out.append((k, line, _inside_function(node) and not _left_alone(node)))
            k += 1
    return out


def apply(source: str, operator, occurrence: int) -> str | None:
    """``source`` with the ``occurrence``-th position of ``operator`` mutated (None: there is no such position)."""
    import parso
    from cosmic_ray.ast import Visitor

    class OneMutation(Visitor):
        count, applied = 0, False

        def visit(self, node):
            for index, _ in enumerate(list(operator.mutation_positions(node))):
                if self.count == occurrence and not self.applied:
                    self.applied = True
                    node = operator.mutate(node, index)
                self.count += 1
            return node

    visitor = OneMutation()
    tree = visitor.walk(parso.parse(source))
    return tree.get_code() if visitor.applied else None


def unified_diff(original: str, mutated: str, label: str) -> str:
    return "".join(
        difflib.unified_diff(
            original.splitlines(keepends=True), mutated.splitlines(keepends=True), f"a/{label}", f"b/{label}", n=2
        )
    )


def label_of(path: Path) -> str:
    """How a source file is named in ids and reports: relative to the working folder where it lies under it."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def mutants_of(source: str, label: str, names: tuple[str, ...] | None = None) -> list[Mutant]:
    """Every mutant of ``source`` by the operators ``names`` (default: all of ``operators()``), in operator order."""
    ops = operators()
    unknown = sorted(set(names or ()) - set(ops))
    if unknown:
        raise ValueError(f"unknown mutation operators {unknown}; known: {sorted(ops)}")
    out, seen = [], {source}
    for name in names or tuple(ops):
        operator = ops[name]()
        per_line: dict[int, int] = {}
        for k, line, mutable in positions(source, operator):
            if not mutable:
                continue
            mutated = apply(source, operator, k)
            n = per_line.get(line, 0)
            per_line[line] = n + 1
            if mutated is None or mutated in seen or not _compiles(mutated, label):
                continue
            seen.add(mutated)
            out.append(Mutant(label, name, line, n, mutated, unified_diff(source, mutated, label)))
    return out


def _compiles(source: str, label: str) -> bool:
    try:
        compile(source, label, "exec")
    except (SyntaxError, ValueError):
        return False
    return True


def read_source(path: Path) -> str:
    """The text of a source file to mutate; a file that is missing or does not parse is a ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--source {path}: no such file (expected a Python source file of the stack)")
    text = path.read_text()
    try:
        compile(text, str(path), "exec")
    except SyntaxError as exc:
        raise ValueError(f"--source {path}: does not parse as Python (line {exc.lineno}: {exc.msg})") from None
    return text
