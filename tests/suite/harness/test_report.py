"""Run reports: typed records -> JSON + Markdown + plots, written atomically."""

from __future__ import annotations

import json
import math

import pytest

from lora_suite.harness.report import RunReport, Series, atomic_write_text, render_markdown
from lora_suite.settings.environment import collect_environment


def _report():
    return RunReport("run-1", "quick", collect_environment())


def test_check_records_and_nan_never_passes():
    r = _report()
    assert r.check("t", "ok", 1.0, "<=", 2.0).passed
    assert not r.check("t", "nan", math.nan, "<=", 2.0).passed
    assert not r.check("t", "nan >=", math.nan, ">=", 0.0).passed
    with pytest.raises(ValueError, match="op='~' is not one of"):
        r.check("t", "bad", 1, "~", 1)
    assert r.summary()["checks_failed"] == 2


def test_write_produces_json_markdown_and_plots(tmp_path):
    r = _report()
    r.notes.append("weights=random (architecture of smollm2-135m, random init)")
    r.check("tests/x.py::test_a", "loss drop", 0.4, ">=", 0.3, source="configs/x.yaml")
    r.add_series(
        Series("tests/x.py::test_a", "loss", ("step", "loss"), ((0, 3.0), (1, 2.0)), plot_x="step", plot_y=("loss",))
    )
    r.add_row("b", "bench", ("impl", "ms"), ("base", 1.0))
    r.add_row("b", "bench", ("impl", "ms"), ("cupy", 1.2))
    md = r.write(tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["environment"]["git_commit"] and data["checks"][0]["passed"] is True
    assert [s["name"] for s in data["series"]] == ["loss", "bench"] and len(data["series"][1]["rows"]) == 2
    text = md.read_text()
    assert "| loss drop | 0.4 | >= 0.3 | PASS | configs/x.yaml |" in text and "weights=random" in text
    assert (tmp_path / "plot_00_loss.png").stat().st_size > 1000
    assert not list(tmp_path.glob(".*")), "temporary files left behind"


def test_add_row_with_other_columns_is_an_error():
    r = _report()
    r.add_row("b", "bench", ("a",), (1,))
    with pytest.raises(ValueError, match="table 'bench' has columns"):
        r.add_row("b", "bench", ("b",), (1,))


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "f.txt"
    atomic_write_text(path, "old")

    with pytest.raises(TypeError):
        atomic_write_text(path, None)  # fails while writing
    assert path.read_text() == "old" and len(list(tmp_path.iterdir())) == 1


def test_markdown_marks_failures():
    r = _report()
    r.check("t", "peak", 7.0, "<=", 6.0, unit=" GiB")
    assert "**FAIL**" in render_markdown(r)


def test_a_long_series_is_compact_in_report_md_and_whole_in_json(tmp_path):
    from lora_suite.harness.report import RunReport, Series, compact_rows

    rows = tuple((i, 10.0 - i / 100) for i in range(1000))
    shown, note = compact_rows(rows)
    assert shown[:10] == list(rows[:10]) and shown[-10:] == list(rows[-10:]) and 30 <= len(shown) <= 45
    assert note.startswith("1000 rows: the first and last 10 and every")
    assert compact_rows(rows[:40]) == (list(rows[:40]), "")
    run = RunReport(run_id="r", selection="quick", environment=collect_environment())
    run.add_series(Series("t::a", "loss per step", ("step", "loss"), rows))
    run.write(tmp_path / "out")
    out = tmp_path / "out"
    md = (out / "report.md").read_text()
    assert "_1000 rows: the first and last 10" in md and "| 999 | 0.01 |" in md
    assert len(json.loads((out / "report.json").read_text())["series"][0]["rows"]) == 1000
    assert any(p.name.startswith("plot_00_loss_per_step") for p in out.glob("*.png")), "a step axis is drawn"


def test_a_series_without_a_step_axis_is_a_table_only():
    from lora_suite.harness.report import Series, plottable

    assert plottable(Series("t", "ratios", ("shape", "ratio"), (("a", 1.0), ("b", 2.0), ("c", 3.0)))) is None
    stepped = plottable(Series("t", "mem", ("step", "mib", "note"), ((1, 2.0, "x"), (2, 3.0, "y"), (3, 4.0, "z"))))
    assert stepped.plot_x == "step" and stepped.plot_y == ("mib",)
