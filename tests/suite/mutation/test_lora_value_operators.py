"""The value operators of ``lora_suite.mutation.lora_value_operators`` (issue 55, item 5): each one's positions and
mutated code on small sources, the guards' behaviour on each type of value (floats and floating tensors changed,
anything else passed through), and on the example's real source: mutants of every class it holds, each of which
imports and runs a forward, backward and merge on the CPU (a form that only crashed would teach nothing)."""

from __future__ import annotations

import importlib.util
import textwrap
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("cosmic_ray", reason="the mutate extra (cosmic-ray) is not installed")
torch = pytest.importorskip("torch")

from lora_suite.mutation import lora_value_operators as V  # noqa: E402
from lora_suite.mutation import mutants as MU  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "plain_lora.py"
NEW = ("LowPrecisionRoundTrip", "CacheFirstValue", "NanToNum", "DropBias", "FlipTraining")


def _method(body: str, name: str = "forward") -> str:
    return f"class L:\n    def {name}(self, x, w, b, a, r):\n" + textwrap.indent(textwrap.dedent(body), " " * 8)


def _changes(source: str, operator: str) -> list[tuple[str, str]]:
    """(the line before, the line after) of each mutant of ``source`` by ``operator``."""
    out = []
    for m in MU.mutants_of(source, "s.py", (operator,)):
        lines = m.diff.splitlines()
        minus = [ln[1:].strip() for ln in lines if ln.startswith("-") and not ln.startswith("---")]
        plus = [ln[1:].strip() for ln in lines if ln.startswith("+") and not ln.startswith("+++")]
        out.append((minus[0], plus[0]))
    return out


RT, NN = V.ROUND_TRIP.format, V.NAN_TO_NUM.format


@pytest.mark.parametrize(
    "operator, body, expected",
    [
        ("LowPrecisionRoundTrip", "scale = a / r\n", [f"scale = {RT('a / r')}"]),
        ("LowPrecisionRoundTrip", "k = a / r\n", []),  # a target that names no scale, delta, weight or output
        ("LowPrecisionRoundTrip", "return x\n", [f"return {RT('x')}"]),  # what forward returns
        ("LowPrecisionRoundTrip", "y = x @ w\n", [f"y = {RT('x @ w')}", f"y = {RT('x')} @ w", f"y = x @ {RT('w')}"]),
        ("LowPrecisionRoundTrip", "k = [a] * 2\n", []),  # a list, a number: not values of a float's or tensor's type
        ("NanToNum", "grad_x = x * 2\n", [f"grad_x = {NN('x * 2')}"]),
        ("NanToNum", "return x, None\n", [f"return {NN('x')}, None"]),  # each element of a returned tuple
        ("NanToNum", "h = x * 2\n", []),
        ("CacheFirstValue", "y = x @ w\n", ['y = self.__dict__.setdefault("_mut_cache_3_12", x @ w)']),
        ("CacheFirstValue", "p, q = x, w\n", ['p, q = self.__dict__.setdefault("_mut_cache_3_15", (x, w))']),
        ("CacheFirstValue", "k = 2\n", []),  # a constant: caching it changes nothing
        ("CacheFirstValue", "for i in x:\n    y = i\n", []),  # inside a loop: another defect than state across calls
        ("DropBias", "y = F.linear(x, w, b)\n", ["y = F.linear(x, w)"]),
        ("DropBias", "m = nn.Linear(4, 4, bias=False, dtype=x)\n", ["m = nn.Linear(4, 4, dtype=x)"]),
        ("DropBias", "m = make(bias=b)\n", ["m = make()"]),
        ("DropBias", "y = self.base(x)\n", ['y = __import__("torch").nn.functional.linear(x, self.base.weight)']),
        ("DropBias", "y = F.linear(x, w)\n", []),
        ("FlipTraining", "p = a if self.training else 0.0\n", ["p = a if (not self.training) else 0.0"]),
        ("FlipTraining", "x.train()\nw.eval()\n", ["x.eval()", "w.train()"]),
        ("FlipTraining", "x.train(False)\n", []),  # a mode argument: .eval() takes none
    ],
)
def test_each_value_operator_makes_its_change(operator, body, expected):
    assert [after for _, after in _changes(_method(body), operator)] == expected


def test_cache_first_value_leaves_init_and_functions_alone():
    assert _changes(_method("y = x @ w\n", "__init__"), "CacheFirstValue") == []
    assert _changes("def f(x, w):\n    y = x @ w\n    return y\n", "CacheFirstValue") == []


def _run(code: str, **names):
    """``code``'s value (an expression) with ``names`` bound."""
    return eval(compile(code, "mutant", "eval"), {}, names)  # noqa: S307 - the operators' own templates


def test_the_round_trip_rounds_floats_and_floating_tensors_through_bf16_and_passes_the_rest():
    scale = 7.3 / 4  # 1.825: not representable in bf16 (8 significant bits)
    rounded = _run(RT("v"), v=scale)
    assert type(rounded) is float and rounded == float(torch.tensor(scale, dtype=torch.bfloat16)) != scale
    t = torch.full((3,), scale, dtype=torch.float32)
    out = _run(RT("v"), v=t)
    assert out.dtype == torch.float32 and torch.equal(out, t.to(torch.bfloat16).float()) and not torch.equal(out, t)
    for other in (12, True, None, {"a": 1}, torch.arange(3)):
        assert _run(RT("v"), v=other) is other


def test_nan_to_num_cleans_floating_tensors_and_passes_the_rest():
    g = torch.tensor([1.0, float("nan"), float("inf")])
    assert torch.isfinite(_run(NN("v"), v=g)).all() and not torch.isfinite(g).all()
    for other in (None, 1.5, torch.arange(3)):
        assert _run(NN("v"), v=other) is other


def test_a_cached_value_is_the_first_call_s():
    source = _method("y = x * 2\nreturn y\n")
    (m,) = MU.mutants_of(source, "s.py", ("CacheFirstValue",))
    space: dict = {}
    exec(compile(m.source, "mutant", "exec"), space)  # noqa: S102 - the mutant under test
    layer = space["L"]()
    assert [layer.forward(x, 0, 0, 0, 0) for x in (1, 5)] == [2, 2]


def test_every_value_operator_is_registered_and_names_what_the_fingerprint_cannot_see():
    ops = MU.operators()
    assert set(NEW) <= set(ops)
    assert all(MU.fingerprint_blind(name) for name in NEW)
    assert not MU.fingerprint_blind("DeleteStatement") and not MU.fingerprint_blind("ReplaceBinaryOperator_Add_Sub")
    # a fingerprint that ran a probe with biases sees a dropped bias; one without does not
    assert MU.fingerprint_blind("DropBias", {"float32: loaded": "x"}) == V.DropBias.FINGERPRINT_BLIND
    assert MU.fingerprint_blind("DropBias", {"float32: loaded": "x", "float32+bias: loaded": "y"}) == ""
    assert MU.fingerprint_blind("NanToNum", {"float32+bias: loaded": "y"}) != ""
    # a bf16 rounding shows in the fp32 configurations (scale 7/3, fp32 values); a bf16-only fingerprint is blind to it
    assert MU.fingerprint_blind("LowPrecisionRoundTrip", {"float32+rslora: loaded": "y"}) == ""
    assert MU.fingerprint_blind("LowPrecisionRoundTrip", {"bfloat16: loaded": "y"}) != ""


def _example_mutants() -> list[MU.Mutant]:
    return MU.mutants_of(MU.read_source(EXAMPLE), "examples/plain_lora.py", NEW)


def test_the_example_gets_mutants_of_every_value_class_it_holds():
    counts = Counter(m.operator for m in _example_mutants())
    # the example has no `training` test and no .train()/.eval(): FlipTraining has nothing there to flip
    assert "training" not in EXAMPLE.read_text() and counts["FlipTraining"] == 0
    assert all(counts[name] >= 1 for name in NEW[:4]), counts
    scale = next(m for m in _example_mutants() if m.operator == "LowPrecisionRoundTrip" and "self.scale = (" in m.diff)
    assert "bfloat16" in scale.diff
    assert any(m.operator == "DropBias" and "linear(x, self.base.weight)" in m.diff for m in _example_mutants())


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make()


def test_each_value_mutant_of_the_example_runs(tmp_path):
    from lora_suite.engine import probes as P
    from lora_suite.implementations import AdapterSpec

    shape = P.BlockShape("tiny", 48, 40, 16, 76)
    spec = AdapterSpec(P.PROBE_TARGETS, 4, 7.3, adapter_dtype=torch.float32)
    crashed = []
    for n, m in enumerate(_example_mutants()):
        path = tmp_path / f"value_mutant_{n}.py"
        path.write_text(m.source)
        try:
            impl = _load(path, path.stem)
            for seed in (0, 1):  # two probes: a value cached on the first is reused on the second
                probe = P.build_probe(impl, shape, spec, torch.float32, "cpu", seed=seed)
                P.run_probe(probe, P.random_inputs(shape, (2, 5), torch.float32, "cpu", seed=seed))
            impl.save_adapter(probe.block, tmp_path / f"saved_{n}")
            impl.merge_adapters(probe.block)
        except Exception as exc:  # noqa: BLE001 - collected: the assertion names every mutant that crashed
            crashed.append(f"{m.id}: {type(exc).__name__}: {exc}")
    assert crashed == []
