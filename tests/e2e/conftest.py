"""End-to-end helpers: headless Chromium pages. The Airflow they use is the session's (`tests/conftest.py`)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.airflow_env import REPO

CHROMIUM = "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else shutil.which("chromium")
ARTIFACTS = REPO / "artifacts"  # screenshots, for humans and CI to look at
needs_chromium = [pytest.mark.browser, pytest.mark.skipif(
    not CHROMIUM, reason="Chromium is not installed (no /usr/bin/chromium, none on PATH); "
    "`apt-get install chromium` to run the browser tests")]


@contextlib.contextmanager
def browser_page(failure_screenshot: str, note: str = "") -> Iterator:
    """A page of headless Chromium (Playwright); on a failure, a full-page screenshot and its path in the error."""
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        try:
            yield page
        except Exception as exc:
            page.screenshot(path=ARTIFACTS / failure_screenshot, full_page=True)
            exc.add_note(f"screenshot: {ARTIFACTS / failure_screenshot}{note}")
            raise
        finally:
            browser.close()
