"""One real Airflow for every end-to-end module: each start costs ~90 s of a two-core machine.

Its DAG folder holds the repo's example DAGs (the browser test triggers the training pipeline)
and the lifecycle DAGs. Package-scoped: it stops after the last end-to-end test, and the
teardown checks that every process it started is gone.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from rayslice.local.airflow_stack import AirflowStack, _alive
from tests.airflow_env import REPO

E2E_DAGS = Path(__file__).with_name("dags")
CHROMIUM = "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else shutil.which("chromium")
ARTIFACTS = REPO / "artifacts"  # screenshots, for humans and CI to look at
needs_chromium = [pytest.mark.browser, pytest.mark.skipif(
    not CHROMIUM, reason="Chromium is not installed (no /usr/bin/chromium, none on PATH); "
    "`apt-get install chromium` to run the browser tests")]


@pytest.fixture(scope="package")
def airflow(cluster, tmp_path_factory: pytest.TempPathFactory):
    dags = tmp_path_factory.mktemp("e2e-dags")
    for source in [*(REPO / "dags").glob("[!_]*.py"), E2E_DAGS / "lifecycle.py"]:
        shutil.copy(source, dags / source.name)
    with AirflowStack(cluster.dashboard_url, cluster.token, dags_folder=dags) as stack:
        components = dict(stack.sessions)
        assert {"scheduler", "triggerer", "api-server", "dag-processor"} <= set(components)
        yield stack
    left = {name: pid for name, pid in components.items() if _alive(pid)}
    assert not left, f"Airflow components still running after stop(): {left}"
    assert not stack.pids(), f"processes of the Airflow stack left behind: {sorted(stack.pids())}"


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
