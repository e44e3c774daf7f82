"""The interactive history page (issue 45), opened in a real headless Chromium: it renders without a console error
offline, hovering shows run id and commit, and a filter changes what is drawn. The screenshot is kept as a CI
artifact (``reports/ci/history-page.png``). Without Chromium or Playwright the browser case skips, saying so, unless
``LORA_SUITE_REQUIRE_BROWSER=1`` (what ``.ci/run`` sets)."""

from __future__ import annotations

import json
from pathlib import Path

from lora_suite.results import history, synthetic_history
from tests.suite.results.headless import chromium, open_offline, page_data

ROOT = Path(__file__).resolve().parents[3]
SHOT = ROOT / "reports" / "ci" / "history-page.png"


def test_ten_thousand_runs_make_one_offline_page_under_ten_megabytes(tmp_path):
    out = tmp_path / "h.html"
    history.write(out, history.collect_rows(synthetic_history.rows(10_000)))
    page = out.read_text()
    assert out.stat().st_size <= 10_000_000, out.stat().st_size
    assert "<script src=" not in page and "https://" not in page.split("<script>")[0]  # nothing fetched: offline
    data = page_data(page)
    assert len(data["runs"]) == 10_000 and len(data["groups"]) == 60
    assert len(data["side"]["gpus"]) == 3 and len(data["side"]["t"]) == 20  # per implementation and tier, per GPU


def test_the_page_renders_in_chromium_and_a_filter_changes_what_is_drawn(tmp_path):
    executable = chromium()
    from playwright.sync_api import sync_playwright

    rows = synthetic_history.rows(2_000)
    out = tmp_path / "h.html"
    history.write(out, history.collect_rows(rows))
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        page = open_offline(browser, out, errors)
        before = page.inner_text("#note")
        drawn = page.evaluate("document.getElementById('chart').data.length")
        page.select_option("#tier", "memory")
        page.wait_for_function(f"document.getElementById('note').textContent !== {json.dumps(before)}")
        after = page.inner_text("#note")
        tiers = page.evaluate("document.getElementById('chart').data.map(t => t.name)")
        hover = page.evaluate("document.getElementById('chart').data[0].text[0]")
        SHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOT), full_page=True)
        browser.close()
    assert errors == []
    assert before.startswith("60 group(s) drawn") and after.startswith("12 group(s) drawn"), (before, after)
    assert drawn > len(tiers) and all(" · memory" in t for t in tiers)
    assert "-memory-" in hover and "commit " in hover and "threshold <= 1.2" in hover  # run id, commit, threshold
