"""`rayslice airflow up|down|status`: the Airflow UI on this machine, over the local simulated cluster.

`up` starts (or reuses) a local cluster and a real Airflow 3 (`AirflowStack`: api-server,
scheduler, dag-processor, triggerer) whose DAG folder is the example DAGs and whose
`ray_default` is that cluster, then returns and leaves it running. What it started is written
to `<RAYSLICE_HOME>/airflow/<name>.json`: each component's session leader PID with its start
time, so `down` (another process, later) stops exactly those sessions, never a reused PID,
and the cluster only if `up` started it. The AIRFLOW_HOME (`<RAYSLICE_HOME>/airflow/<name>/`)
stays, so runs and the generated password survive a `down`/`up`.
"""

from __future__ import annotations

import json
import re
import secrets
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
from pydantic import BaseModel

from rayslice.core.exceptions import RaysliceError
from rayslice.core.queue import TEAM_PATTERN
from rayslice.local import local_cluster
from rayslice.local.airflow_stack import AirflowStack
from rayslice.local.processes import alive, send_signal, session_members

USERNAME = "admin"
DEFAULT_PORT = 8080


class UiRecord(BaseModel):
    """What `up` started: enough for `down` in another process to stop exactly that."""

    name: str
    url: str
    username: str
    password: str
    home: str
    cluster: str
    dashboard_url: str
    started_cluster: bool
    sessions: dict[str, int]  # component -> session leader PID
    started_at: dict[str, float]  # PID -> its start time (psutil create_time), against PID reuse

    @property
    def path(self) -> Path:
        return record_path(self.name)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(self.model_dump_json(indent=2))
        self.path.chmod(0o600)  # it holds the password

    @classmethod
    def load(cls, name: str) -> UiRecord | None:
        path = record_path(name)
        return cls.model_validate_json(path.read_text()) if path.exists() else None


def state_dir() -> Path:
    return local_cluster.state_dir().parent / "airflow"


def record_path(name: str) -> Path:
    return state_dir() / f"{name}.json"


def example_dags() -> Path:
    import rayslice.dags

    return Path(rayslice.dags.__file__).parent


def _started_at(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def processes(record: UiRecord) -> set[int]:
    """Live processes of the sessions `up` started; a session whose leader PID now names another process is skipped."""
    ours = set()
    for pid in record.sessions.values():
        started = record.started_at.get(str(pid))
        if alive(pid) and _started_at(pid) != started:
            continue  # the PID was reused by someone else's process
        ours |= {member for member in session_members({pid})
                 if started is None or (_started_at(member) or 0) >= started}
    return ours


def healthy(record: UiRecord) -> bool:
    try:
        health = httpx.get(f"{record.url}/api/v2/monitor/health", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return False
    return all((health.get(key) or {}).get("status") == "healthy"
               for key in ("metadatabase", "scheduler", "triggerer", "dag_processor"))


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        # As the API server binds (SO_REUSEADDR): a port our last `down` left in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _cluster(name: str, emit: Callable[[str], None]) -> tuple[local_cluster.ClusterRecord, bool]:
    """The local cluster `name`: reused when it runs, else started (two v6e-16, a v6e-4, 3 GPUs)."""
    try:
        record = local_cluster.ClusterRecord.load(name)
    except (RaysliceError, FileNotFoundError):
        record = None
    if record is not None:
        try:
            if local_cluster.alive_nodes(record.dashboard_url, record.token):
                emit(f"reusing the local cluster {name!r} at {record.dashboard_url}")
                return record, False
        except Exception:  # noqa: BLE001 - not answering: a leftover record
            pass
        emit(f"the local cluster {name!r} is recorded but does not answer: stopping what is left of it")
        local_cluster.down(name)
    emit(f"starting the local cluster {name!r}: a head, two v6e-16 and a v6e-4 slice, a 3-GPU node")
    return local_cluster.up(local_cluster.DEMO_SPEC, name=name), True


def dags_to_serve(home: Path, dags_folder: Path | None, examples: bool) -> Path:
    """The DAG folder Airflow reads: the user's, the examples, or a folder linking both (Airflow has one)."""
    if dags_folder is None or not examples:
        return dags_folder or example_dags()
    both = home / "dags"
    if both.is_symlink() or both.is_file():
        both.unlink()
    both.mkdir(exist_ok=True)
    for link, target in (("yours", dags_folder), ("rayslice_examples", example_dags())):
        (both / link).unlink(missing_ok=True)
        (both / link).symlink_to(target, target_is_directory=True)  # Airflow follows links when it lists DAG files
    return both


#: An Airflow connection id that `AIRFLOW_CONN_<ID>` can carry (Airflow upper-cases the id's variable name).
_CONN_ID = re.compile(r"[a-z][a-z0-9_]{0,63}")


def team_connection_env(teams: dict[str, str], dashboard_url: str | None, token: str | None) -> dict[str, str]:
    """`AIRFLOW_CONN_<ID>` for each (connection id -> team): a `ray` connection to the local cluster in that team.

    Raises a clear error for an id or team the queue would refuse (checked before anything starts: called
    with no URL first).
    """
    env = {}
    for conn_id, team in teams.items():
        if not _CONN_ID.fullmatch(conn_id) or conn_id == "ray_default":
            raise RaysliceError(f"--team-connection {conn_id}={team}: the connection id must be lowercase letters, "
                                "digits and '_', starting with a letter (not ray_default, which `up` sets), "
                                "e.g. ray_research=research")
        if len(team) > 64 or not re.fullmatch(TEAM_PATTERN, team):
            raise RaysliceError(f"--team-connection {conn_id}={team}: the team must be up to 64 letters, digits, "
                                "'.', '_', '-' (parts joined by '/'), e.g. research or research/vision")
        if dashboard_url is not None:
            conn = local_cluster.ray_connection(dashboard_url, token)
            conn["extra"]["team"] = team
            env[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps(conn)
    return env


def member_connection_id(cluster: str) -> str:
    """The `ray` connection id `--cluster-set` gives a local cluster: `ray_<name>` (`set-a` -> `ray_set_a`)."""
    return "ray_" + re.sub(r"[^a-z0-9_]", "_", cluster.lower())


def cluster_set_env(sets: dict[str, list[str]], *, load: Callable[[str], local_cluster.ClusterRecord] | None = None,
                    ) -> dict[str, str]:
    """`AIRFLOW_CONN_<ID>` for each cluster set (connection id -> local cluster names, in order of preference).

    Each member cluster gets a `ray` connection of its own (`member_connection_id`), and the set lists them,
    with a checkpoint root on this machine's disk, which every local cluster reads (`shared_root`). With
    `load` None only the ids and names are checked (before anything starts); else each cluster's record is
    read with it, and one that is not recorded is refused with how to start it.
    """
    env: dict[str, str] = {}
    for conn_id, clusters in sets.items():
        flag = f"--cluster-set {conn_id}={','.join(clusters)}"
        if not _CONN_ID.fullmatch(conn_id) or conn_id == "ray_default":
            raise RaysliceError(f"{flag}: the connection id must be lowercase letters, digits and '_', starting "
                                "with a letter (not ray_default, which `up` sets), e.g. tpus=a,b")
        if not clusters or any(not name for name in clusters) or len(set(clusters)) != len(clusters):
            raise RaysliceError(f"{flag}: name each local cluster once, in order of preference, e.g. {conn_id}=a,b")
        members = [member_connection_id(name) for name in clusters]
        if len(set(members)) != len(members):
            raise RaysliceError(f"{flag}: these clusters' connection ids would be the same ("
                                f"{', '.join(f'{n} -> {m}' for n, m in zip(clusters, members, strict=True))}); "
                                "name clusters that differ in more than '-', '_' or case")
        if conn_id in members:
            raise RaysliceError(f"{flag}: {conn_id!r} is also the connection id of cluster "
                                f"{clusters[members.index(conn_id)]!r}; give the set another id")
        if load is None:
            continue
        for name, member in zip(clusters, members, strict=True):
            try:
                record = load(name)
            except RaysliceError:
                raise RaysliceError(f"{flag}: no local cluster {name!r} is recorded; start it first with "
                                    f"`rayslice local up --name {name}`") from None
            env[f"AIRFLOW_CONN_{member.upper()}"] = json.dumps(
                local_cluster.ray_connection(record.dashboard_url, record.token))
        root = local_cluster.state_dir().parent / "checkpoints" / conn_id
        env[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps({"conn_type": "ray", "extra": {
            "clusters": members, "checkpoint_root": f"file://{root}", "shared_root": True}})
    return env


def up(name: str = "default", *, cluster: str = "default", port: int = DEFAULT_PORT, dags_folder: Path | None = None,
       examples: bool | None = None, adopt_cluster: bool = False, startup_timeout: float = 300,
       team_connections: dict[str, str] | None = None, cluster_sets: dict[str, list[str]] | None = None,
       emit: Callable[[str], None] = print) -> tuple[UiRecord, bool]:
    """Start the UI (and the cluster if needed); returns (its record, whether it was already up).

    `dags_folder`: the user's DAGs (default: the examples); `examples` serves the examples beside them
    (default: only without `dags_folder`). `adopt_cluster`: `down` also stops the (reused) cluster, as if
    `up` had started it (the demo hands its cluster over this way). `port` 0 picks a free port.
    `team_connections`: connection id -> team: more `ray` connections to the same cluster, one per team
    (`extra.team`), beside `ray_default`; an Airflow already up keeps the connections it was started with.
    `cluster_sets`: connection id -> local cluster names: a cluster set over those clusters (`cluster_set_env`,
    docs/cluster-sets.md), each of which must be up already.
    """
    team_connection_env(team_connections or {}, dashboard_url=None, token=None)  # bad ids or teams: before any start
    sets_env = cluster_set_env(cluster_sets or {}, load=local_cluster.ClusterRecord.load)
    existing = UiRecord.load(name)
    if existing is not None:
        if processes(existing) and healthy(existing):
            return existing, True
        emit(f"Airflow {name!r} is recorded but not healthy: stopping what is left of it first")
        down(name, keep_cluster=True)
        adopt_cluster = adopt_cluster or existing.started_cluster
    if port and not _port_free(port):
        raise RaysliceError(f"port {port} is taken on 127.0.0.1; choose another with --port (0 for any free port)")
    ray, started_cluster = _cluster(cluster, emit)
    home = state_dir() / name
    home.mkdir(parents=True, exist_ok=True)
    passwords = home / "passwords.json"
    try:
        password = json.loads(passwords.read_text())[USERNAME]
    except (OSError, ValueError, KeyError):
        password = secrets.token_urlsafe(12)
    examples = dags_folder is None if examples is None else examples
    stack = AirflowStack(ray.dashboard_url, ray.token, dags_folder=dags_to_serve(home, dags_folder, examples),
                         username=USERNAME, password=password, home=home, port=port,
                         startup_timeout=startup_timeout,
                         extra_env={**team_connection_env(team_connections or {}, ray.dashboard_url, ray.token),
                                    **sets_env})
    emit(f"starting Airflow (api-server, scheduler, dag-processor, triggerer); logs in {home / 'logs'}")
    try:
        stack.start()
    except BaseException:
        if started_cluster:
            local_cluster.down(cluster)
        raise
    record = UiRecord(name=name, url=stack.url, username=USERNAME, password=password, home=str(home),
                      cluster=cluster, dashboard_url=ray.dashboard_url,
                      started_cluster=started_cluster or adopt_cluster, sessions=dict(stack.sessions),
                      started_at={str(pid): _started_at(pid) for pid in stack.sessions.values()})
    record.save()
    return record, False


def down(name: str = "default", *, keep_cluster: bool = False, grace: float = 20) -> int:
    """Stop exactly the sessions `up` recorded (SIGTERM, then SIGKILL), and its cluster if it started it.

    Returns how many Airflow processes were running. Raises if any is left.
    """
    record = UiRecord.load(name)
    if record is None:
        raise RaysliceError(f"no Airflow named {name!r} is recorded in {state_dir()}; nothing to stop")
    running = processes(record)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5)):
        for pid in processes(record):
            send_signal(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and processes(record):
            time.sleep(0.2)
    left = processes(record)
    if left:
        raise RaysliceError(f"Airflow processes {sorted(left)} did not exit")
    if record.started_cluster and not keep_cluster:
        try:
            local_cluster.down(record.cluster)
        except RaysliceError:
            pass  # its record is gone: stopped by hand already
    record.path.unlink(missing_ok=True)
    return len(running)


def describe(record: UiRecord) -> str:
    return (f"Airflow UI:  {record.url}\nlogin:       {record.username} / {record.password}\n"
            f"Slices page: {record.url}/plugin/slices\nRay:         {record.dashboard_url} "
            f"(local cluster {record.cluster!r})")


__all__ = ["UiRecord", "describe", "down", "processes", "up"]
