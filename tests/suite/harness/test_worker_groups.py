"""lora_suite.harness.worker_groups on the CPU: tests that import the model code share a few xdist workers."""

from __future__ import annotations

import ast
import json
import os
import textwrap
from pathlib import Path

import pytest

from lora_suite.harness import worker_groups as WG

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[3]
MODEL_CODE = (
    "tier.prepare",
    "build_model",
    "import peft",
    "importorskip('peft'",
    "peft_impl",
    "MF.judge",  # lora_suite.judges.model_function: a transformers model of each architecture
    "AO.judge",
    "CA.judge",  # lora_suite.judges.combined_adapters: a Llama  # lora_suite.judges.adapter_options: a transformers model of each option's architecture
)  # what in a test's source builds a model


def test_three_of_eight_workers_build_models_and_never_fewer_than_one():
    assert [WG.groups_for(n) for n in (1, 2, 3, 4, 8, 16)] == [1, 1, 1, 2, 3, 6]


def test_the_marker_is_read_from_the_source_of_a_module_or_a_function(tmp_path):
    (tmp_path / "test_m.py").write_text("import pytest\npytestmark = [pytest.mark.gpu, pytest.mark.model_code]\n")
    (tmp_path / "test_f.py").write_text(
        "import pytest\n\n@pytest.mark.model_code\n@pytest.mark.parametrize('i', [1])\ndef test_a(i):\n    pass\n\n"
        "def test_b():\n    pass\n"
    )
    (tmp_path / "test_bad.py").write_text("def (:\n")
    assert WG.is_marked("test_m.py::test_anything[x-y]", tmp_path)
    assert WG.is_marked("test_f.py::test_a[1]", tmp_path) and not WG.is_marked("test_f.py::test_b", tmp_path)
    assert not WG.is_marked("test_bad.py::test_c", tmp_path) and not WG.is_marked("missing.py::test_d", tmp_path)
    assert not WG.is_marked("test_m.py", tmp_path)  # a module's own node id is not a test


def test_every_quick_test_that_builds_a_model_is_marked():
    """The quick tier runs over workers by default: an unmarked model-building test would import the model code in
    a worker that otherwise never does (seconds of the tier's wall time), a marked kernel test would wait behind the
    model builders."""
    seen = []
    for path in sorted((ROOT / "tiers" / "quick").glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                builds = any(k in ast.unparse(node) for k in MODEL_CODE)
                marked = WG.is_marked(f"tiers/quick/{path.name}::{node.name}", ROOT)
                assert builds == marked, f"{path.name}::{node.name}: builds a model: {builds}, marked: {marked}"
                seen.append(builds)
    assert sum(seen) >= 4 and not all(seen), "the scan found the model-building tests it exists for, and others"


def test_over_workers_the_marked_tests_share_two_workers_and_every_test_runs(pytester, monkeypatch):
    pytest.importorskip("xdist", reason="pytest-xdist is a declared dependency: pip install pytest-xdist")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    gpu: gpu\n")
    pytester.makepyfile(
        test_sample=textwrap.dedent(
            """
            import json, os, pytest

            def _note(name):
                with open("where.jsonl", "a") as f:
                    f.write(json.dumps([name, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")

            @pytest.mark.model_code
            @pytest.mark.parametrize("i", range(4))
            def test_builds(i):
                _note(f"builds{i}")

            @pytest.mark.parametrize("j", range(8))
            def test_kernel(j):
                _note(f"kernel{j}")
            """
        )
    )
    xdist = ["-p", "xdist.plugin"] if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD") else []
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *xdist, "-n", "4", "--dist", "loadgroup")
    # on pytest 9.2, xdist's own loadgroup cannot rename node ids: the suite's scheduler reads the marker itself
    assert result.ret == 0, result.stdout.str()
    rows = [json.loads(line) for line in (pytester.path / "where.jsonl").read_text().splitlines()]
    builders = {w for name, w in rows if name.startswith("builds")}
    assert len(rows) == 12 and len(builders) == 2, rows  # 4 workers: two groups, two processes import the model code


def test_the_scheduler_keeps_xdists_own_groups_and_deals_the_marked_tests(pytester):
    pytest.importorskip("xdist", reason="pytest-xdist is a declared dependency: pip install pytest-xdist")
    pytester.makepyfile(
        test_m="import pytest\npytestmark = pytest.mark.model_code\n\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n"
    )
    xdist = ["-p", "xdist.plugin"] if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD") else []
    config = pytester.parseconfigure(*xdist, "--tx", "8*popen", "--dist", "loadgroup")
    sched = WG.make_scheduler(config, None)
    assert sched._split_scope("test_x.py::test_c[1]@mine") == "mine"  # an xdist_group suffix, where pytest allows it
    assert sched._split_scope("test_x.py::test_c[1]") == "test_x.py::test_c[1]"  # unmarked: its own unit
    firsts = [sched._split_scope(n) for n in ("test_m.py::test_a", "test_m.py::test_b", "test_m.py::test_a")]
    assert firsts == ["model_code-0", "model_code-1", "model_code-0"]  # asked again: the same group
