"""A real Airflow 3 (api-server, scheduler, dag-processor, triggerer) for a local Ray cluster.

Used by the browser end-to-end test and handy for demos: the repo's `dags/` are the DAG
folder, `ray_default` points at the cluster's dashboard, and the Slices plugin is loaded
from the installed package's `airflow.plugins` entry point.

Why these choices:

- **SQLite**: one machine, no extra service to install, start and stop. Airflow 3 has no
  SequentialExecutor any more and allows the LocalExecutor on SQLite (SQLite serialises
  writes; with a handful of tasks that is fine), so tasks of one run still go in parallel.
  The DB is switched to WAL journaling, so readers (UI, API) do not wait on a writer;
  even so, on a loaded machine an API call can stall for tens of seconds behind a lock,
  so clients should poll with generous timeouts.
- **A throwaway AIRFLOW_HOME and free ports** (API, worker and triggerer log servers), so
  several stacks, and other engineers' Airflows, never collide.
- **`use_job_schedule = False`, DAGs unpaused at creation**: only runs someone triggers
  happen; a scheduled run of a daily DAG would otherwise compete for the same slices.
- **Each process in its own session**: `stop()` ends exactly those sessions (the
  LocalExecutor's workers and task processes included) by session id, never by name.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

import httpx

import rayslice.dags
from rayslice.core.exceptions import RaysliceError
from rayslice.local import processes
from rayslice.local.local_cluster import free_port, ray_connection

EXAMPLE_DAGS = Path(rayslice.dags.__file__).parent  # the installed example DAGs (dags/ in a checkout)
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
_HEALTH = ("metadatabase", "scheduler", "triggerer", "dag_processor")


def _airflow_bin() -> str:
    candidate = Path(sys.executable).with_name("airflow")
    return str(candidate) if candidate.exists() else "airflow"


class AirflowStack:
    """`with AirflowStack(dashboard_url) as af:` -> Airflow at `af.url`, user `af.username`/`af.password`."""

    def __init__(self, dashboard_url: str, token: str | None = None, *, dags_folder: Path = EXAMPLE_DAGS,
                 username: str = "admin", password: str = "admin", parallelism: int = 2,
                 startup_timeout: float = 300, home: Path | None = None, port: int = 0,
                 extra_env: dict[str, str] | None = None) -> None:
        """`home` given: that AIRFLOW_HOME is used and kept (its DB survives a stop); else a throwaway one.

        `port` 0: a free one. `extra_env`: Airflow settings for this stack only (AIRFLOW__...).
        """
        self.dashboard_url, self.token, self.dags_folder = dashboard_url, token, Path(dags_folder)
        self.extra_env = dict(extra_env or {})
        self.username, self.password = username, password
        self.parallelism, self.startup_timeout = parallelism, startup_timeout
        self.home: Path | None = Path(home) if home else None
        self._keep_home = home is not None
        self.port = port
        self.sessions: dict[str, int] = {}  # component -> PID of its session leader
        self._procs: dict[int, subprocess.Popen] = {}  # kept, so we (not the GC) reap them
        self._started: set[int] = set()  # every session ever started, for pids() after stop()
        self._secret, self._log_ports = "", (0, 0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The environment every component (and `airflow` CLI call) of this stack runs with."""
        assert self.home is not None
        return {
            **os.environ,
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.home}/airflow.db",
            # A busy machine's lock waits outlast SQLite's 5 s default; a scheduler that hit it exited.
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS": "rayslice.local.airflow_db.CONNECT_ARGS",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": str(self.parallelism),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
            # Explicit, so a bundle list inherited from the caller (the tests' Airflow) cannot replace it.
            "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps([{
                "name": "dags-folder", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
                "kwargs": {"path": str(self.dags_folder)}}]),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
            "AIRFLOW__CORE__AUTH_MANAGER":
                "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{self.username}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.home / "passwords.json"),
            "AIRFLOW__API__BASE_URL": f"{self.url}/",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__API_AUTH__JWT_SECRET": self._secret,
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(self._log_ports[0]),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(self._log_ports[1]),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            # Task processes talk to the API server; behind a SQLite lock on a loaded machine one
            # call can take ~50 s, and the 5 s default then kills the task (its retry conflicts).
            "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "120",
            "AIRFLOW_CONN_RAY_DEFAULT": json.dumps(ray_connection(self.dashboard_url, self.token)),
            **self.extra_env,
        }

    def start(self) -> AirflowStack:
        """Migrate a fresh SQLite DB, start the four components, return once all report healthy."""
        if self.sessions:
            raise RaysliceError("this AirflowStack is already started")
        if not self._keep_home:
            self.home = Path(tempfile.mkdtemp(prefix="rayslice-airflow-stack-"))
        assert self.home is not None
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        passwords = self.home / "passwords.json"
        passwords.write_text(json.dumps({self.username: self.password}))
        passwords.chmod(0o600)
        self.port, self._log_ports = self.port or free_port(), (free_port(), free_port())
        self._secret = secrets.token_hex(32)
        try:
            # A kept home whose DB this Airflow version already migrated skips `db migrate` (~20-40 s).
            migrated = self.home / f".migrated-{importlib.metadata.version('apache-airflow')}"
            if not (migrated.exists() and (self.home / "airflow.db").exists()):
                self._run_once(["db", "migrate"], "db-migrate", timeout=self.startup_timeout)
                with closing(sqlite3.connect(self.home / "airflow.db")) as db:  # persists in the file
                    db.execute("PRAGMA journal_mode=WAL")
                migrated.touch()
            for component in COMPONENTS:
                self.sessions[component] = self._spawn(self._args(component), component)
            self._wait_healthy(time.monotonic() + self.startup_timeout)
        except BaseException:
            try:
                self.stop(keep_logs=True)
            except RaysliceError:
                pass  # the start's own error says more; pids() still lists what is left
            raise
        return self

    def _args(self, component: str) -> list[str]:
        if component == "api-server":
            return [component, "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        return [component]

    def restart(self, component: str, timeout: float = 30) -> int:
        """Kill one component's whole session at once (SIGKILL: no cleanup, as in a crash), start a new one.

        Returns the new session's PID. What the old process held (a triggerer's triggers) is
        left for Airflow to recover, which is what a test of a crash wants to see.
        """
        old = self.sessions[component]
        for pid in processes.session_members({old}):
            processes.send_signal(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while processes.session_members({old}):
            if time.monotonic() > deadline:
                raise RaysliceError(f"airflow {component} (session {old}) did not exit after SIGKILL")
            self._reap()
            time.sleep(0.1)
        self._reap()
        self.sessions[component] = self._spawn(self._args(component), component)
        return self.sessions[component]

    def _spawn(self, args: list[str], name: str) -> int:
        assert self.home is not None
        with open(self.home / "logs" / f"{name}.log", "ab") as out:
            proc = subprocess.Popen([_airflow_bin(), *args], env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self._procs[proc.pid] = proc
        self._started.add(proc.pid)
        return proc.pid

    def _run_once(self, args: list[str], name: str, timeout: float) -> None:
        pid = self._spawn(args, name)
        self.sessions[name] = pid
        try:
            status = self._procs[pid].wait(timeout)
        except subprocess.TimeoutExpired:
            status = None
        finally:
            self._end_sessions({pid})
            del self.sessions[name]
        if status != 0:
            raise RaysliceError(f"`airflow {' '.join(args)}` failed ({status}); see {self.log(name)}")

    def log(self, name: str) -> Path:
        assert self.home is not None
        return self.home / "logs" / f"{name}.log"

    def _wait_healthy(self, deadline: float) -> None:
        health: dict = {}
        while time.monotonic() < deadline:
            for component, pid in self.sessions.items():
                if self._procs[pid].poll() is not None:
                    raise RaysliceError(f"airflow {component} exited early; see {self.log(component)}:\n"
                                        + _tail(self.log(component)))
            try:
                health = httpx.get(f"{self.url}/api/v2/monitor/health", timeout=5).json()
                if all((health.get(key) or {}).get("status") == "healthy" for key in _HEALTH):
                    return
            except (httpx.HTTPError, ValueError):
                pass  # the API server is still starting
            time.sleep(1)
        raise RaysliceError(f"Airflow at {self.url} was not healthy within {self.startup_timeout:.0f} s "
                            f"(last health: {health}); logs in {self.home / 'logs'}")

    def api_token(self) -> str:
        """A JWT for the REST API, from the simple auth manager's login endpoint."""
        resp = httpx.post(f"{self.url}/auth/token", json={"username": self.username, "password": self.password},
                          timeout=30)
        resp.raise_for_status()
        return resp.json()["access_token"]

    def pids(self) -> set[int]:
        """Every live process this stack started: its sessions' members (executor workers, task runners too).

        Still answers after `stop()`, so a test can check that nothing was left behind.
        """
        return processes.session_members(self._started)

    def stop(self, grace: float = 20, keep_logs: bool = False) -> None:
        """End exactly the sessions this stack started (SIGTERM, then SIGKILL), then delete its home.

        With `keep_logs` (a failed start, or a `with` block that raised) the home and its
        `logs/` stay, for whoever debugs it.
        """
        self._end_sessions(self._started, grace)
        left = self.pids()
        if left:
            raise RaysliceError(f"Airflow processes {sorted(left)} did not exit")
        self.sessions.clear()
        self._procs.clear()
        if self.home and not keep_logs and not self._keep_home:
            shutil.rmtree(self.home, ignore_errors=True)

    def _end_sessions(self, sessions: set[int], grace: float = 20) -> None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5)):
            for pid in processes.session_members(sessions):
                processes.send_signal(pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and processes.session_members(sessions):
                self._reap()
                time.sleep(0.2)
        self._reap()

    def _reap(self) -> None:
        for proc in self._procs.values():
            proc.poll()

    def __enter__(self) -> AirflowStack:
        return self.start()

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.stop(keep_logs=exc_type is not None)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
