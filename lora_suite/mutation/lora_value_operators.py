"""Mutation operators for the defect classes the syntactic operators of ``lora_operators`` never make (issue 55: the
six defects that passed every check of quick and convergence), on cosmic-ray's operator interface:

- ``LowPrecisionRoundTrip``: a value goes through bfloat16 and back to its own type, v -> fl_bf16(v) (8 significant
  bits: a relative error up to 2⁻⁹). The real class: a scale α/r or a merged delta s·B·A formed in 16 bits inside
  an fp32 path (Unsloth's and PEFT's merges in the adapter's dtype; a scale held in a bf16 tensor);
- ``CacheFirstValue``: a value a method computes is computed on its first call and that first value reused ever
  after. The real class: state across calls (a cast adapter cached for speed that goes stale after the next
  optimizer step, a merged weight kept after unmerge);
- ``NanToNum``: a gradient or an output is passed through ``torch.nan_to_num``, non-finite -> finite. The real
  class: a stack that cleans NaN/Inf out of its gradients, so that a diverging run looks healthy;
- ``DropBias``: the base layer's bias is lost: a ``bias=`` keyword removed, ``linear(x, w, b)`` -> ``linear(x, w)``,
  ``obj.base(x)`` -> ``linear(x, obj.base.weight)``. The real class: a stack written for Llama's bias-free
  projections, run on Qwen2's q/k/v, which carry a bias;
- ``FlipTraining``: ``obj.training`` -> ``(not obj.training)``, ``.train()`` <-> ``.eval()``. The real class: dropout
  applied in eval or left out in training, a merge on ``eval()`` taken the wrong way.

Each mutated value goes through a guard that changes floats and floating tensors only and passes anything else
through as it is (``ROUND_TRIP``, ``NAN_TO_NUM``): a mutant that only crashes on a value of another type would teach
nothing. The guard imports torch itself (``__import__("torch")``), so a file that names torch otherwise still runs.

Each operator's ``FINGERPRINT_BLIND`` says why ``engine.fingerprint`` (one forward and backward of a probe block in
train mode, finite inputs; fp32 and bf16, α/r = 7/3 exact in neither; a biased probe where the stack adapts biased
layers) cannot show a mutant of its class equivalent, unless the fingerprint ran the configuration its
``FINGERPRINT_SEEN_IN`` names: ``lora_suite.mutation.mutate`` keeps such a survivor a survivor.
"""

from __future__ import annotations

try:  # the mutate extra: ``mutants.operators()`` names it when it is missing
    from cosmic_ray.operators.operator import Example, Operator

    from lora_suite.mutation.lora_operators import _fragment, _is_call, _trailer_name
except ImportError as exc:
    raise ImportError(f"{exc}: install lora-gpu-suite[mutate]") from exc

TORCH = '__import__("torch")'
ROUND_TRIP = (
    "(lambda v, t=" + TORCH + ": float(t.tensor(v, dtype=t.bfloat16)) if type(v) is float "
    "else v.to(t.bfloat16).to(v.dtype) if t.is_tensor(v) and v.is_floating_point() else v)({})"
)
NAN_TO_NUM = "(lambda v, t=" + TORCH + ": t.nan_to_num(v) if t.is_tensor(v) and v.is_floating_point() else v)({})"
# identifier parts (split on "_") that name a scale, a delta or merged weight, an output; and a gradient
VALUE_WORDS = {"scale", "scaling", "delta", "merged", "merge", "weight", "out", "output", "result", "y", "logits"}
GRAD_WORDS = {"grad", "grads", "gradient", "dy", "dx", "dout", "out", "output", "y", "logits"}
VALUE_FUNCTIONS = ("forward", "backward", "__call__", "merge")  # a return of these is an output (prefix match)
NOT_VALUES = {"len", "int", "str", "bool", "list", "dict", "set", "tuple", "sorted", "range", "isinstance", "type"}
BASE_LAYERS = ("base", "base_layer")
_ROUNDING = "the fingerprint ran no fp32 configuration, where a bf16 rounding shows"


def _parts(node) -> set[str]:
    """The lower-case ``_``-separated parts of every name in ``node``."""
    leaves, out = [node], set[str]()
    while leaves:
        n = leaves.pop()
        if n.type == "name":
            out.update(p for p in n.value.lower().split("_") if p)
        leaves.extend(getattr(n, "children", ()))
    return out


def _function(node):
    return node.search_ancestor("funcdef")


def _is_value(node) -> bool:
    """Could ``node`` be a float or a tensor: not a literal, a container, a test, a tuple or a call of ``NOT_VALUES``."""
    if node.type in ("number", "string", "strings", "fstring", "keyword", "lambdef", "comparison", "not_test"):
        return False
    if node.type in ("and_test", "or_test", "testlist_star_expr", "testlist", "exprlist", "star_expr"):
        return False
    if node.type == "atom" and node.children[0].type == "operator" and node.children[0].value in "[{":
        return False
    first = node.children[0] if node.type in ("atom_expr", "power") else None
    return not (first is not None and first.type == "name" and first.value in NOT_VALUES)


def _assignment(node):
    """(target, value) of ``target = value`` (one ``=``, no annotation), else None."""
    if node.type != "expr_stmt" or len(node.children) != 3:
        return None
    if node.children[1].type != "operator" or node.children[1].value != "=":
        return None
    return node.children[0], node.children[2]


def _returned(node):
    """The value of ``return value``, else None."""
    if node.type == "return_stmt" and len(node.children) == 2:
        return node.children[1]
    return None


class WrapValue(Operator):
    """A value (a child of the node) wrapped in ``template``; ``_slots`` says which children."""

    template = "{}"

    def _slots(self, node) -> list[int]:
        raise NotImplementedError

    def mutation_positions(self, node):
        for i in self._slots(node):
            yield (node.children[i].start_pos, node.children[i].end_pos)

    def _code(self, node, i) -> str:
        return self.template.format(node.children[i].get_code(include_prefix=False))

    def mutate(self, node, index):
        i = self._slots(node)[index]
        old = node.children[i]
        new = _fragment(self._code(node, i))
        new.get_first_leaf().prefix = old.get_first_leaf().prefix
        new.parent = node
        node.children[i] = new
        return node


def _assigned_slot(node, words: set[str]) -> list[int] | None:
    """For an assignment: its value's slot where the value is a value and the target names one of ``words`` (else
    no slot); None where ``node`` is no assignment."""
    pair = _assignment(node)
    if pair is None:
        return None
    target, value = pair
    return [2] if _is_value(value) and _parts(target) & words else []


class LowPrecisionRoundTrip(WrapValue):
    """A scale, a delta or merged weight, or an output rounded through bf16 and back (``ROUND_TRIP``): the value of
    an assignment whose target names one (``VALUE_WORDS``), a value returned by ``forward``/``backward``/
    ``__call__``/``merge…``, and each factor of a product (``*``, ``@``)."""

    FINGERPRINT_BLIND = _ROUNDING
    FINGERPRINT_SEEN_IN = "float32"  # its fp32 configurations: inexact scale 7/3, fp32 inputs and adapters
    template = ROUND_TRIP

    def _slots(self, node):
        if (slot := _assigned_slot(node, VALUE_WORDS)) is not None:
            return slot
        value = _returned(node)
        if value is not None:
            fn = _function(node)
            named = fn is not None and fn.name.value.startswith(VALUE_FUNCTIONS)
            return [1] if _is_value(value) and named else []
        if node.type == "term" and any(k.type == "operator" and k.value in ("*", "@") for k in node.children[1::2]):
            return [i for i in range(0, len(node.children), 2) if _is_value(node.children[i])]
        return []

    @classmethod
    def examples(cls):
        return (Example("def f(a, r):\n    s = a / r\n", "def f(a, r):\n    s = " + ROUND_TRIP.format("a / r") + "\n"),)


class NanToNum(WrapValue):
    """A gradient or an output through ``torch.nan_to_num`` (``NAN_TO_NUM``): the value of an assignment whose
    target names one (``GRAD_WORDS``), and a value returned by ``forward``/``backward``/``__call__`` (each
    element of a returned tuple)."""

    FINGERPRINT_BLIND = "the fingerprint's inputs and gradients are finite"
    template = NAN_TO_NUM

    def _slots(self, node):
        if (slot := _assigned_slot(node, GRAD_WORDS)) is not None:
            return slot
        if node.type in ("testlist", "testlist_star_expr") and _returned(node.parent) is node:
            fn = _function(node)
            if fn is not None and fn.name.value in VALUE_FUNCTIONS[:3]:
                return [i for i in range(0, len(node.children), 2) if _is_value(node.children[i])]
            return []
        value = _returned(node)
        fn = _function(node) if value is not None else None
        if fn is not None and fn.name.value in VALUE_FUNCTIONS[:3] and _is_value(value):
            return [1]
        return []

    @classmethod
    def examples(cls):
        return (
            Example(
                "def backward(g):\n    return g\n", "def backward(g):\n    return " + NAN_TO_NUM.format("g") + "\n"
            ),
        )


def _self_of(node) -> str | None:
    """The first parameter's name of the method ``node`` is in, where it is ``self`` and the method not ``__init__``."""
    fn = _function(node)
    if fn is None or fn.name.value in ("__init__", "__new__", "__post_init__"):
        return None
    params = fn.get_params()
    return "self" if params and params[0].name.value == "self" else None


def _in_loop(node) -> bool:
    """Is ``node`` inside a ``for`` or ``while`` of its own function."""
    loop, fn = node.search_ancestor("for_stmt", "while_stmt"), _function(node)
    return loop is not None and (fn is None or loop.search_ancestor("funcdef") is fn)


class CacheFirstValue(WrapValue):
    """``x = expr`` in a method (not ``__init__``), outside a loop, becomes
    ``x = self.__dict__.setdefault("_mut_cache_L_C", expr)``: the first call's value, reused on every later call
    (``expr`` still runs, its value is dropped). A constant is left alone (caching it changes nothing)."""

    FINGERPRINT_BLIND = "the fingerprint calls each layer's forward once, on one model"

    def _slots(self, node):
        pair = _assignment(node)
        if pair is None or _self_of(node) is None or _in_loop(node):
            return []
        value = pair[1]
        constant = value.type in ("number", "string", "strings", "fstring", "keyword")
        return [] if constant or value.type == "yield_expr" else [2]

    def _code(self, node, i):
        value = node.children[i]
        line, col = value.start_pos
        code = value.get_code(include_prefix=False)
        code = f"({code})" if value.type in ("testlist_star_expr", "testlist") else code
        return f'self.__dict__.setdefault("_mut_cache_{line}_{col}", {code})'

    @classmethod
    def examples(cls):
        before = "class C:\n    def f(self, x):\n        y = x + 1\n"
        return (Example(before, before.replace("x + 1", 'self.__dict__.setdefault("_mut_cache_3_12", x + 1)')),)


def _is_bias_keyword(arg) -> bool:
    return arg.type == "argument" and arg.children[0].type == "name" and arg.children[0].value == "bias"


def _callee(call) -> str | None:
    """The name a call trailer calls: ``f`` of ``f(...)``, ``linear`` of ``F.linear(...)``."""
    before = call.get_previous_sibling()
    if before is None:
        return None
    return before.value if before.type == "name" else _trailer_name(before)


def _drop(arglist, k: int) -> None:
    """Remove argument ``k`` of ``arglist`` and one comma beside it (the one after, else the one before)."""
    kids = arglist.children
    prefix = kids[k].get_first_leaf().prefix
    if k + 1 < len(kids) and kids[k + 1].type == "operator" and kids[k + 1].value == ",":
        del kids[k : k + 2]
        if k < len(kids):
            kids[k].get_first_leaf().prefix = prefix
    else:
        del kids[k - 1 : k + 1]


class DropBias(Operator):
    """The base layer's bias lost: a ``bias=`` keyword removed from a call; the third positional argument of a
    ``linear(x, w, b)`` call removed; ``obj.base(x)`` / ``obj.base_layer(x)`` -> ``linear(x, obj.base.weight)``."""

    FINGERPRINT_BLIND = "the fingerprint's probe block has no bias"
    FINGERPRINT_SEEN_IN = "+bias"  # engine.fingerprint.BIAS: where the fingerprint ran a biased probe, it can see this

    def _edits(self, node) -> list[tuple[str, int]]:
        if _is_call(node) and len(node.children) == 3:
            args = node.children[1]
            if _is_bias_keyword(args):
                return [("keyword", 1)]
            if args.type == "arglist":
                out = [("keyword", i) for i, kid in enumerate(args.children) if _is_bias_keyword(kid)]
                positional = [i for i, kid in enumerate(args.children) if kid.type != "operator"]
                positional = [i for i in positional if args.children[i].type != "argument"]
                if _callee(node) == "linear" and len(positional) >= 3:
                    out.append(("third", positional[2]))
                return out
        if node.type in ("atom_expr", "power") and len(node.children) >= 3:
            name, call = node.children[-2], node.children[-1]
            arg = call.children[1] if _is_call(call) and len(call.children) == 3 else None
            one = arg is not None and arg.type not in ("arglist", "argument")
            if _trailer_name(name) in BASE_LAYERS and one:
                return [("base", len(node.children) - 1)]
        return []

    def mutation_positions(self, node):
        for kind, i in self._edits(node):
            kid = node.children[i] if kind == "base" else node.children[1]
            kid = kid.children[i] if kind != "base" and kid.type == "arglist" else kid
            yield (kid.start_pos, kid.end_pos)

    def mutate(self, node, index):
        kind, i = self._edits(node)[index]
        if kind == "base":
            obj = "".join(k.get_code(include_prefix=False) for k in node.children[:-1])
            arg = node.children[-1].children[1].get_code(include_prefix=False)
            new = _fragment(f"{TORCH}.nn.functional.linear({arg}, {obj}.weight)")
            new.get_first_leaf().prefix = node.get_first_leaf().prefix
            return new
        if node.children[1].type == "arglist":
            _drop(node.children[1], i)
        else:
            del node.children[1]
        return node

    @classmethod
    def examples(cls):
        return (
            Example("y = F.linear(x, w, b)", "y = F.linear(x, w)"),
            Example("m = nn.Linear(4, 4, bias=False)", "m = nn.Linear(4, 4)"),
        )


class FlipTraining(Operator):
    """``obj.training`` -> ``(not obj.training)``; ``.train()`` -> ``.eval()`` and ``.eval()`` -> ``.train()``."""

    FINGERPRINT_BLIND = "the fingerprint runs in one mode, without dropout"

    def _edits(self, node) -> list[int]:
        if node.type not in ("atom_expr", "power"):
            return []
        kids, out = node.children, []
        for i, kid in enumerate(kids):
            name = _trailer_name(kid) if i else None
            if name == "training" and i == len(kids) - 1:
                out.append(i)
            elif name in ("train", "eval") and i + 1 < len(kids) and kids[i + 1].get_code().strip() == "()":
                out.append(i)
        return out

    def mutation_positions(self, node):
        for i in self._edits(node):
            yield (node.children[i].start_pos, node.children[i].end_pos)

    def mutate(self, node, index):
        i = self._edits(node)[index]
        leaf = node.children[i].children[1]
        if leaf.value == "training":
            new = _fragment(f"(not {node.get_code(include_prefix=False)})")
            new.get_first_leaf().prefix = node.get_first_leaf().prefix
            return new
        leaf.value = "eval" if leaf.value == "train" else "train"
        return node

    @classmethod
    def examples(cls):
        return (Example("y = f(x) if self.training else x", "y = f(x) if (not self.training) else x"),)


VALUE_OPERATORS = (LowPrecisionRoundTrip, CacheFirstValue, NanToNum, DropBias, FlipTraining)
