"""End-to-end helpers: the session Airflow's REST API and DAG files added to it, headless Chromium pages.

The Airflow they use is the session's (`tests/conftest.py`).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.airflow_env import REPO
from tests.conftest import wait_until

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


@pytest.fixture(scope="session")
def airflow_api(airflow) -> Iterator[httpx.Client]:
    """The session Airflow's REST API (`/api/v2`), as its admin."""
    with httpx.Client(base_url=f"{airflow.url}/api/v2", timeout=60,
                      headers={"Authorization": f"Bearer {airflow.api_token()}"}) as client:
        yield client


def add_dags(airflow, api: httpx.Client, source: Path, dag_ids: Iterable[str]) -> httpx.Client:
    """Put a DAG file in the session Airflow's DAG folder, wait until its DAGs are registered, unpause them.

    A file the session's Airflow started with (tests/conftest.py) is left as it is: copied again, it
    would only be parsed again."""
    target = airflow.dags_folder / source.name
    if not (target.exists() and target.read_bytes() == source.read_bytes()):
        shutil.copy(source, target)
    dag_ids = list(dag_ids)
    assert wait_until(lambda: all(api.get(f"/dags/{d}").status_code == 200 for d in dag_ids), timeout=240,
                      interval=1), f"the DAG processor did not register {', '.join(dag_ids)}"
    for dag_id in dag_ids:
        api.patch(f"/dags/{dag_id}", json={"is_paused": False}).raise_for_status()
    return api


def xcom(api: httpx.Client, ti_path: str, key: str = "return_value", map_index: int = -1):
    """A task instance's XCom as a Python value, None while there is none (`ti_path`: its REST path under /api/v2).

    The REST API gives a value as the XCom backend stores it: JSON, or a Python literal."""
    import ast
    import json

    resp = api.get(f"{ti_path}/xcomEntries/{key}", params={"deserialize": True, "map_index": map_index})
    if resp.status_code == 404:
        return None
    resp.raise_for_status()
    value = resp.json()["value"]
    for parse in (json.loads, ast.literal_eval):
        if isinstance(value, str):
            try:
                value = parse(value)
            except (ValueError, SyntaxError):
                pass
    return value
