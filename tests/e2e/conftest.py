"""One real Airflow for every end-to-end module: each start costs ~90 s of a two-core machine.

Started the way a user starts it, `rayslice airflow up` (a separate process that returns and
leaves Airflow running), on the session's cluster, and stopped with `rayslice airflow down`.
Its DAG folder holds the repo's example DAGs (the browser test triggers the training pipeline)
and the lifecycle DAGs. Package-scoped: it stops after the last end-to-end test, and the
teardown checks that every process it started is gone and that the cluster was left alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rayslice.local import airflow_ui, local_cluster
from tests.airflow_env import REPO

E2E_DAGS = Path(__file__).with_name("dags")
CHROMIUM = "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else shutil.which("chromium")
ARTIFACTS = REPO / "artifacts"  # screenshots, for humans and CI to look at
needs_chromium = [pytest.mark.browser, pytest.mark.skipif(
    not CHROMIUM, reason="Chromium is not installed (no /usr/bin/chromium, none on PATH); "
    "`apt-get install chromium` to run the browser tests")]


def rayslice(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The `rayslice` command of this venv, as a user runs it (RAYSLICE_HOME: the session cluster's)."""
    cli = Path(sys.executable).with_name("rayslice")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")} | {"COLUMNS": "200"}
    return subprocess.run([str(cli), *args], capture_output=True, text=True, timeout=timeout, env=env)


class CliAirflow:
    """The Airflow `rayslice airflow up --name <name>` runs, read from its record (the URL survives a down/up)."""

    def __init__(self, name: str, cluster: str, dags: Path) -> None:
        self.name, self.cluster, self.dags = name, cluster, dags
        self.port = 0

    def up(self) -> subprocess.CompletedProcess:
        out = rayslice("airflow", "up", "--name", self.name, "--cluster", self.cluster, "--port", str(self.port),
                       "--dags-folder", str(self.dags))
        assert out.returncode == 0, out.stdout + out.stderr
        self.port = int(re.search(r"Airflow UI:\s+http://127\.0\.0\.1:(\d+)", out.stdout).group(1))
        return out

    def down(self) -> subprocess.CompletedProcess:
        out = rayslice("airflow", "down", "--name", self.name)
        assert out.returncode == 0, out.stdout + out.stderr
        return out

    @property
    def record(self) -> airflow_ui.UiRecord:
        record = airflow_ui.UiRecord.load(self.name)
        assert record is not None, f"Airflow {self.name!r} is not up"
        return record

    url = property(lambda self: self.record.url)
    username = property(lambda self: self.record.username)
    password = property(lambda self: self.record.password)
    home = property(lambda self: Path(self.record.home))

    def api_token(self) -> str:
        resp = httpx.post(f"{self.url}/auth/token", json={"username": self.username, "password": self.password},
                          timeout=30)
        resp.raise_for_status()
        return resp.json()["access_token"]


@pytest.fixture(scope="package")
def airflow(cluster, tmp_path_factory: pytest.TempPathFactory):
    dags = tmp_path_factory.mktemp("e2e-dags")
    for source in [*(REPO / "dags").glob("[!_]*.py"), E2E_DAGS / "lifecycle.py"]:
        shutil.copy(source, dags / source.name)
    stack = CliAirflow(f"e2e-{os.getpid()}", cluster.name, dags)
    stack.first_up = stack.up()
    try:
        assert {"scheduler", "triggerer", "api-server", "dag-processor"} <= set(stack.record.sessions)
        yield stack
    finally:
        record = airflow_ui.UiRecord.load(stack.name)
        if record is not None:
            stack.down()
            assert not airflow_ui.processes(record), "processes of `rayslice airflow up` left after down"
    assert local_cluster.alive_nodes(cluster.dashboard_url, cluster.token), "down stopped a cluster it did not start"


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
