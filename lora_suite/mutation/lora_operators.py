"""Mutation operators for the defects a LoRA stack tends to have, on cosmic-ray's operator interface
(``cosmic_ray.operators.operator.Operator``: ``mutation_positions(node)`` yields one position per possible mutation
of a parso node, ``mutate(node, index)`` returns the node that replaces it):

- ``DeleteStatement``: a simple statement becomes ``pass`` (a forgotten scale, a skipped freeze, a lost copy);
- ``RemoveTranspose``: ``x.t()``, ``x.T``, ``x.mT``, ``x.transpose(...)`` become ``x``;
- ``RemoveDetach`` / ``InsertDetach``: ``x.detach()`` becomes ``x``; a call's result in arithmetic gets a
  ``.detach()`` (a gradient path cut);
- ``RemoveCast``: ``x.to(...)``, ``x.float()``, ``x.half()``, ``x.bfloat16()``, ``x.double()``, ``x.type(...)``
  become ``x``;
- ``SwapArguments``: two neighbouring positional arguments of a call change places (``F.linear(a, x)``);
- ``SqrtToArgument``: ``math.sqrt(x)`` / ``torch.sqrt(x)`` becomes ``x`` (rsLoRA's scale).

This module is imported by ``mutants.operators()`` only, which turns a missing ``mutate`` extra (parso, cosmic-ray)
into one line naming it; here the import is guarded so that nothing imports the extra at collection time.
"""

from __future__ import annotations

try:  # the mutate extra: ``mutants.operators()`` names it when it is missing
    import parso
    from cosmic_ray.operators.operator import Example, Operator
    from parso.python.tree import Keyword
except ImportError as exc:
    raise ImportError(f"{exc}: install lora-gpu-suite[mutate]") from exc

TRANSPOSES = ("t", "T", "mT", "transpose")
CASTS = ("to", "float", "half", "bfloat16", "double", "type")
SQRTS = (("math", "sqrt"), ("torch", "sqrt"))


def _fragment(code: str):
    """The parso node of one expression (its first leaf's prefix emptied)."""
    node = parso.parse(code).children[0]
    return node.children[0] if node.type == "simple_stmt" else node


def _is_docstring(node) -> bool:
    return node.type == "string" or (node.type == "strings")


class DeleteStatement(Operator):
    """A simple statement inside a function becomes ``pass`` (a docstring and ``pass`` itself are left alone)."""

    def mutation_positions(self, node):
        parent = node.parent
        if parent is None or parent.type != "simple_stmt" or node.type in ("newline", "operator"):
            return
        if _is_docstring(node) or (node.type == "keyword" and node.value == "pass"):
            return
        yield (node.start_pos, node.end_pos)

    def mutate(self, node, index):
        return Keyword("pass", node.start_pos, prefix=node.get_first_leaf().prefix)

    @classmethod
    def examples(cls):
        return (Example("def f():\n    x = 1\n", "def f():\n    pass\n"),)


def _trailer_name(trailer) -> str | None:
    """``name`` of a ``.name`` trailer, else None."""
    if trailer.type == "trailer" and trailer.children[0].type == "operator" and trailer.children[0].value == ".":
        return trailer.children[1].value
    return None


def _is_call(trailer) -> bool:
    return trailer.type == "trailer" and trailer.children[0].type == "operator" and trailer.children[0].value == "("


class RemoveMethodCall(Operator):
    """``x.<name>(...)`` (or the attribute ``x.<name>``) becomes ``x``, for each name of ``names``; ``cases``: the
    (before, after) code of the examples."""

    names: tuple[str, ...] = ()
    cases: tuple[tuple[str, str], ...] = ()

    def _spans(self, node):
        """(start, stop) indices of the children each mutation removes."""
        if node.type not in ("atom_expr", "power"):
            return
        kids = node.children
        for i, kid in enumerate(kids):
            if i == 0 or _trailer_name(kid) not in self.names:
                continue
            stop = i + 2 if i + 1 < len(kids) and _is_call(kids[i + 1]) else i + 1
            yield i, stop

    def mutation_positions(self, node):
        for start, stop in self._spans(node):
            yield (node.children[start].start_pos, node.children[stop - 1].end_pos)

    def mutate(self, node, index):
        start, stop = list(self._spans(node))[index]
        kids = node.children[:start] + node.children[stop:]
        if len(kids) == 1:
            return kids[0]
        node.children = kids
        for kid in kids:
            kid.parent = node
        return node

    @classmethod
    def examples(cls):
        return tuple(Example(before, after) for before, after in cls.cases)


class RemoveTranspose(RemoveMethodCall):
    names = TRANSPOSES
    cases = (("y = w.t() @ x", "y = w @ x"), ("y = w.T", "y = w"))


class RemoveDetach(RemoveMethodCall):
    names = ("detach",)
    cases = (("y = x.detach().clone()", "y = x.clone()"),)


class RemoveCast(RemoveMethodCall):
    names = CASTS
    cases = (("a = self.a.to(x.dtype)", "a = self.a"), ("y = x.float()", "y = x"))


class InsertDetach(Operator):
    """A call's result that is an operand of ``+ - * / @`` gets ``.detach()``."""

    def _operands(self, node):
        if node.type not in ("arith_expr", "term"):
            return []
        return [
            i
            for i, kid in enumerate(node.children)
            if kid.type in ("atom_expr", "power")
            and _is_call(kid.children[-1])
            and _trailer_name(kid.children[-2]) != "detach"
        ]

    def mutation_positions(self, node):
        for i in self._operands(node):
            yield (node.children[i].start_pos, node.children[i].end_pos)

    def mutate(self, node, index):
        operand = node.children[self._operands(node)[index]]
        extra = _fragment("_.detach()").children[1:]
        operand.children = operand.children + extra
        for kid in extra:
            kid.parent = operand
        return node

    @classmethod
    def examples(cls):
        return (Example("y = f(x) + g(x)", "y = f(x).detach() + g(x)"),)


def _positional(arglist) -> list[int]:
    """Indices in ``arglist.children`` of the positional arguments (not ``k=v``, ``*a``, ``**k``)."""
    out = []
    for i, kid in enumerate(arglist.children):
        if kid.type == "operator":
            continue
        if kid.type == "argument":
            continue
        out.append(i)
    return out


class SwapArguments(Operator):
    """Two neighbouring positional arguments of a call change places."""

    def _pairs(self, node):
        if not _is_call(node) or len(node.children) != 3 or node.children[1].type != "arglist":
            return []
        pos = _positional(node.children[1])
        return [(a, b) for a, b in zip(pos, pos[1:]) if b == a + 2]

    def mutation_positions(self, node):
        for a, b in self._pairs(node):
            args = node.children[1].children
            yield (args[a].start_pos, args[b].end_pos)

    def mutate(self, node, index):
        a, b = self._pairs(node)[index]
        args = node.children[1].children
        pa, pb = args[a].get_first_leaf().prefix, args[b].get_first_leaf().prefix
        args[a], args[b] = args[b], args[a]
        args[a].get_first_leaf().prefix, args[b].get_first_leaf().prefix = pa, pb
        return node

    @classmethod
    def examples(cls):
        return (Example("y = F.linear(a, x)", "y = F.linear(x, a)"),)


class SqrtToArgument(Operator):
    """``math.sqrt(x)`` (or ``torch.sqrt(x)``) becomes ``x``."""

    def mutation_positions(self, node):
        if node.type not in ("atom_expr", "power") or len(node.children) != 3:
            return
        base, attr, call = node.children
        arg = call.children[1] if _is_call(call) and len(call.children) == 3 else None
        if base.type == "name" and (base.value, _trailer_name(attr)) in SQRTS and arg is not None:
            if arg.type not in ("arglist", "argument"):
                yield (node.start_pos, node.end_pos)

    def mutate(self, node, index):
        arg = node.children[2].children[1]
        prefix = node.get_first_leaf().prefix
        code = arg.get_code(include_prefix=False)
        new = _fragment(f"({code})" if arg.type not in ("name", "number", "atom_expr", "power", "atom") else code)
        new.get_first_leaf().prefix = prefix
        return new

    @classmethod
    def examples(cls):
        return (Example("s = a / math.sqrt(r)", "s = a / r"),)


LORA_OPERATORS = (
    DeleteStatement,
    RemoveTranspose,
    RemoveDetach,
    InsertDetach,
    RemoveCast,
    SwapArguments,
    SqrtToArgument,
)
