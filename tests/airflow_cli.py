"""Airflow started the way a user starts it: `rayslice airflow up` / `down`, as separate processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx

from rayslice.local import airflow_ui


def rayslice(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The `rayslice` command of this venv, as a user runs it (RAYSLICE_HOME: the session cluster's).

    The tests' own Airflow settings stay out; `env` adds settings for what the command starts.
    """
    cli = Path(sys.executable).with_name("rayslice")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")} | {"COLUMNS": "200"} | (env or {})
    return subprocess.run([str(cli), *args], capture_output=True, text=True, timeout=timeout, env=env)


class CliAirflow:
    """The Airflow `rayslice airflow up --name <name>` runs, read from its record (the URL survives a down/up)."""

    def __init__(self, name: str, cluster: str, dags: Path, settings: dict[str, str] | None = None) -> None:
        self.name, self.cluster, self.dags, self.settings = name, cluster, dags, dict(settings or {})
        self.port = 0
        self.first_up: subprocess.CompletedProcess | None = None

    @property
    def dags_folder(self) -> Path:
        return self.dags

    def up(self) -> subprocess.CompletedProcess:
        out = rayslice("airflow", "up", "--name", self.name, "--cluster", self.cluster, "--port", str(self.port),
                       "--dags", str(self.dags), env=self.settings)
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


def get_json(api: httpx.Client, path: str) -> dict | None:
    """The JSON at `path` of Airflow's REST API, or None (not there yet, or the API stalled behind a SQLite
    lock: poll again)."""
    try:
        resp = api.get(path)
    except httpx.TransportError:
        return None
    return resp.json() if resp.status_code == 200 else None
