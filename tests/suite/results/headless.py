"""The history page's browser tests' shared parts: the headless Chromium they open it in (skipped, saying so, where
Chromium or Playwright is missing, unless ``LORA_SUITE_REQUIRE_BROWSER=1``, what ``.ci/run`` sets), a page opened
offline with its console errors collected, and the page's data read back from its HTML."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    try:
        import playwright  # noqa: F401
    except ImportError:
        found = None
    if found is None:
        if os.environ.get("LORA_SUITE_REQUIRE_BROWSER") == "1":
            pytest.fail("LORA_SUITE_REQUIRE_BROWSER=1 and no Chromium (or no playwright) is installed")
        pytest.skip("no headless Chromium and playwright here: the history page is not opened in a browser")
    return found


def open_offline(browser, page_file: Path, errors: list[str], width: int = 1400, height: int = 1100):
    """``page_file`` in a new page that may fetch nothing but files; console errors and page errors go to ``errors``.
    Returns once the chart is drawn."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.route("**/*", lambda route: route.abort() if not route.request.url.startswith("file:") else route.continue_())
    page.goto(page_file.as_uri())
    page.wait_for_selector("#chart .main-svg", timeout=60_000)
    return page


def page_data(page_html: str) -> dict:
    return json.loads(page_html.split("<script id='data' type='application/json'>")[1].split("</script>")[0])
