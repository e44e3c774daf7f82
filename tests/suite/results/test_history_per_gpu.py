"""The latest night per GPU type, side by side (issue 59, the nightly over a fleet), over a synthetic fleet of three
GPU types (``synthetic_history.fleet``): the pure function's cells exactly (each GPU's latest run, never an older one;
a GPU without a run of a tier has an empty column, never another GPU's value), the same tables through the nightly's
own path (rows in a SQLite results store, ``lora-suite history --ledger STORE``), and that page in headless Chromium:
three GPU columns with the expected latest values, and the GPU selector changing what the chart draws (its screenshot:
``reports/ci/history-per-gpu.png``)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from lora_suite.cli import main as lora_suite
from lora_suite.results import history, ledger, synthetic_history
from lora_suite.results.history_data import Group
from lora_suite.results.history_latest import latest_per_gpu
from tests.suite.results.headless import chromium, open_offline, page_data

SHOT = Path(__file__).resolve().parents[3] / "reports" / "ci" / "history-per-gpu.png"  # kept beside history-page.png
H100, H200, A100 = synthetic_history.GPUS
RUN = "20260303T021700Z-quick"  # the fleet's last night of quick: every GPU type's run has this id


def _cell(value, threshold=None, op="", passed=True):
    """What a cell shows, as the page draws it."""
    return (value, threshold, op, passed)


def _shown(point):
    """A side-by-side cell (the figure's point in that GPU's latest run) as the page shows it."""
    return None if point is None else (point.value, point.threshold, point.op, point.passed)


def _check0(night: int, gpu: str) -> float:
    return 1 + night / 100 + synthetic_history.GPUS.index(gpu) / 1000  # fleet's docstring


def _table(tables, tier: str):
    (found,) = [t for t in tables if (t.implementation, t.tier) == ("cupy", tier)]
    return found


def test_each_gpu_type_shows_its_latest_run_side_by_side():
    rows = synthetic_history.fleet()
    tables = latest_per_gpu(history.collect_rows(rows[::-1]))  # recorded in any order: the latest is by time
    assert [(t.implementation, t.tier) for t in tables] == [("cupy", "memory"), ("cupy", "quick")]
    quick = _table(tables, "quick")
    assert quick.gpus == (A100, H100, H200) and quick.figures == ["check 0", "check 1", "step ms"]
    assert {g: (h.run, h.when, h.commit) for g, h in quick.latest.items()} == {
        g: (RUN, dt.datetime(2026, 3, 3, 2, 17, tzinfo=dt.timezone.utc), "0000003") for g in (A100, H100, H200)
    }
    for gpu in quick.gpus:
        assert _shown(quick.cell("check 0", gpu)) == _cell(_check0(3, gpu), 1.2, "<=", True)
        assert _shown(quick.cell("step ms", gpu)) == _cell(50.0 + 10 * synthetic_history.GPUS.index(gpu) + 3)
    assert _shown(quick.cell("check 1", H200)) == _cell(
        1.5, 1.2, "<=", False
    )  # its last night failed, the others passed
    assert _shown(quick.cell("check 1", H100)) == _cell(1.0, 1.2, "<=", True)
    assert quick.latest[H200].regression == "check check 1: passed -> failed" and quick.latest[H100].regression == ""


def test_a_gpu_without_a_run_of_the_tier_has_an_empty_column():
    memory = _table(latest_per_gpu(history.collect_rows(synthetic_history.fleet())), "memory")
    assert memory.gpus == (A100, H100, H200)  # every GPU type of the history has its column
    assert A100 not in memory.latest and all(memory.cell(f, A100) is None for f in memory.figures)
    assert _shown(memory.cell("check 0", H100)) == _cell(_check0(3, H100), 1.2, "<=", True)


def test_the_latest_run_is_per_gpu_and_a_figure_it_lacks_is_not_taken_from_an_older_run():
    rows = [
        r
        for r in synthetic_history.fleet()
        if not (r["gpu"] == H200 and r["run_id"] == "20260303T021700Z-memory")  # the H200 missed its last memory night
        and not (r["gpu"] == H100 and r["run_id"] == RUN and r["check"] == "step ms")  # its last quick lacks step ms
    ]
    tables = latest_per_gpu(history.collect_rows(rows))
    memory, quick = _table(tables, "memory"), _table(tables, "quick")
    assert memory.latest[H200].run == "20260302T021700Z-memory" and memory.latest[H100].run == "20260303T021700Z-memory"
    assert _shown(memory.cell("check 0", H200)) == _cell(
        _check0(2, H200), 1.2, "<=", True
    )  # its night 2, not the H100's 3
    assert _shown(memory.cell("check 0", H100)) == _cell(_check0(3, H100), 1.2, "<=", True)
    assert quick.cell("step ms", H100) is None and _shown(quick.cell("step ms", H200)) == _cell(63.0)


def test_two_groups_of_one_gpu_implementation_and_tier_are_refused():
    when = dt.datetime(2026, 3, 1, tzinfo=dt.timezone.utc)
    twice = [Group(H100, "cupy", "quick", runs=[(when, f"r{i}")]) for i in range(2)]
    with pytest.raises(ValueError, match="two groups of NVIDIA H100 80GB HBM3 · cupy · quick"):
        latest_per_gpu(twice)


def _page_from_a_store(tmp_path):
    """The fleet's rows in a SQLite results store (the store ``--record`` and ``persist`` write), drawn by the history
    command the nightly's history job runs."""
    store = tmp_path / "results.sqlite"
    assert ledger.append(store, synthetic_history.fleet()) == 60
    out = tmp_path / "history" / "history.html"
    assert lora_suite(["history", "--ledger", str(store), "--html", str(out)]) == 0
    return out


def test_the_nightly_history_command_keeps_every_gpu_type_of_one_run_id(tmp_path):
    """The GPU types start together: each type's run of one tier has the same run id, under its own group. Every one
    of them reaches the page, and its side-by-side tables are those of ``latest_per_gpu``."""
    data = page_data(_page_from_a_store(tmp_path).read_text())
    s = data["s"]
    assert sorted(s[g["gpu"]] for g in data["groups"]) == sorted([A100, H100, H100, H200, H200])
    assert [s[g] for g in data["side"]["gpus"]] == [A100, H100, H200]
    memory, quick = data["side"]["t"]
    assert (s[quick["impl"]], s[quick["tier"]]) == ("cupy", "quick")
    assert [data["runs"][i][0] for i in quick["runs"]] == [RUN] * 3 and memory["runs"][0] == -1
    cells = {s[name]: row for name, row in quick["rows"]}
    assert cells["check 1"] == [[1.0, 1, "<=", 1.2], [1.0, 1, "<=", 1.2], [1.5, 0, "<=", 1.2]]
    assert cells["step ms"] == [[73.0, 1], [53.0, 1], [63.0, 1]]
    assert all(row[0] == 0 for _, row in memory["rows"])  # the A100's empty column


def _side(page) -> list[dict]:
    """Each side-by-side table the page shows: its caption, GPU columns, latest-run cells and figure rows' texts."""
    return page.evaluate(
        """[...document.querySelectorAll('#side table.side')].map(t => ({
             caption: t.caption.textContent,
             gpus: [...t.rows[0].cells].slice(1).map(c => c.textContent),
             selected: [...t.rows[0].cells].slice(1).map(c => c.classList.contains('sel')),
             latest: [...t.rows[1].cells].slice(1).map(c => c.innerText.replace(/\\n/g, ' ')),
             rows: Object.fromEntries([...t.rows].slice(2).map(r => [r.cells[0].textContent,
                                       [...r.cells].slice(1).map(c => [c.textContent, c.className])]))}))"""
    )


def _traces(page) -> list[str]:
    return page.evaluate("document.getElementById('chart').data.filter(t => t.showlegend !== false).map(t => t.name)")


def test_three_gpu_types_side_by_side_in_chromium_and_the_gpu_selector_changes_the_chart(tmp_path):
    executable = chromium()
    from playwright.sync_api import sync_playwright

    out = _page_from_a_store(tmp_path)
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        page = open_offline(browser, out, errors)
        page.select_option("#impl", "cupy")
        page.select_option("#tier", "quick")
        quick = _side(page)
        every_gpu = _traces(page)
        page.select_option("#gpu", H200)
        page.wait_for_function("document.getElementById('note').textContent.startsWith('1 group(s) drawn')")
        one_gpu, selected = _traces(page), _side(page)[0]["selected"]
        page.select_option("#gpu", "(all)")
        page.wait_for_function("document.getElementById('note').textContent.startsWith('3 group(s) drawn')")
        back = _traces(page)
        page.select_option("#tier", "memory")
        memory = _side(page)
        page.select_option("#tier", "(all)")
        both = [t["caption"] for t in _side(page)]
        SHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOT), full_page=True)
        browser.close()
    assert errors == []
    (table,) = quick
    assert table["caption"] == "cupy · quick" and table["gpus"] == [A100, H100, H200]
    assert table["latest"] == [f"{RUN} 2026-03-03"] * 2 + [f"{RUN} 2026-03-03 regression"]
    assert table["rows"]["check 0"] == [["1.032 pass", "pass"], ["1.03 pass", "pass"], ["1.031 pass", "pass"]]
    assert table["rows"]["check 1"][2] == ["1.5 FAIL", "fail"] and table["rows"]["step ms"][0] == ["73", ""]
    assert sorted(every_gpu) == [f"{g} · cupy · quick" for g in (A100, H100, H200)] == sorted(back)
    assert one_gpu == [f"{H200} · cupy · quick"] and selected == [False, False, True]  # the table keeps every GPU
    (table,) = memory
    assert table["latest"][0] == "no run" and all(row[0] == ["", ""] for row in table["rows"].values())
    assert both == ["cupy · memory", "cupy · quick"]  # "(all)": each tier's table
