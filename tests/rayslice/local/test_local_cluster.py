"""`rayslice local up/down`: real `ray start` processes, stopped by PID, never anyone else's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rayslice.core.exceptions import RaysliceError
from rayslice.local import local_cluster, processes
from tests.conftest import end_sessions, wait_until

RAYSLICE = str(Path(sys.executable).with_name("rayslice"))


def cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAYSLICE_HOME": str(home)}
    return subprocess.run([RAYSLICE, *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path


def test_down_stops_exactly_its_own_processes(cluster, home: Path):
    """The session's cluster is the bystander: "another Ray on this machine", which must be untouched."""
    started = cli("local", "up", "--tpu", "v6e-4", "--token", "--name", "mine", home=home)
    assert started.returncode == 0, started.stdout + started.stderr
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAYSLICE_HOME", str(home))
        record = local_cluster.ClusterRecord.load("mine")
    try:
        assert record.dashboard_url in started.stdout
        mine = local_cluster.owned_pids(record)
        theirs = local_cluster.owned_pids(cluster)
        assert mine and theirs and not (mine & theirs)

        # Ray's own detection made the node a TPU host of a v6e-4 slice.
        nodes = local_cluster.alive_nodes(record.dashboard_url, record.token)
        tpu = next(n for n in nodes if "TPU" in n["resources_total"])
        assert tpu["resources_total"]["TPU-v6e-4-head"] == 1
        assert tpu["labels"]["ray.io/tpu-pod-type"] == "v6e-4"
        assert tpu["labels"]["ray.io/tpu-worker-id"] == "0"

        # --token turns on Ray token auth: the Jobs API refuses a request without it.
        assert httpx.get(f"{record.dashboard_url}/api/version", timeout=10).status_code == 401
        assert record.token not in started.stdout
    finally:
        stopped = cli("local", "down", "--name", "mine", home=home)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert not [pid for pid in mine if processes.alive(pid)]
    assert all(processes.alive(node.pid) for node in cluster.nodes)  # the other cluster is untouched ...
    headers = {"Authorization": f"Bearer {cluster.token}"} if cluster.token else {}
    assert httpx.get(f"{cluster.dashboard_url}/api/version", timeout=10, headers=headers).status_code == 200  # serving


def test_every_nodes_raylet_runs_with_the_idle_settings(cluster):
    """The settings reach the processes that read them: each node's raylet, whose children (the dashboard and
    runtime-env agents, the workers) inherit its environment and read each setting from it at import. (The
    agents' own /proc environ is no witness: Ray's process title overwrites it.)"""
    raylets = {}
    for pid in local_cluster.owned_pids(cluster):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"/raylet"):
                raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                raylets[pid] = dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
        except OSError:  # a process that ended meanwhile
            continue
    assert len(raylets) == len(cluster.nodes), raylets.keys()
    for environ in raylets.values():
        assert {key: environ.get(key) for key in local_cluster.IDLE_CPU_SETTINGS} == local_cluster.IDLE_CPU_SETTINGS


def test_capacity_command_lists_every_slice(cluster, home: Path):
    result = cli("capacity", "--address", cluster.dashboard_url, "--json", home=home)
    assert result.returncode == 0, result.stderr
    snapshot = json.loads(result.stdout)
    assert sorted(s["pod_type"] for s in snapshot["slices"]) == ["v6e-16", "v6e-16", "v6e-4"]


def test_a_second_cluster_with_the_same_name_is_refused(home: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RAYSLICE_HOME", str(home))
    local_cluster.ClusterRecord(name="taken", gcs_address="", dashboard_url="", temp_dir="/nonexistent").save()
    with pytest.raises(local_cluster.RaysliceError, match="already recorded"):
        local_cluster.up(local_cluster.ClusterSpec(), name="taken")



def test_a_cluster_that_fails_to_start_says_why_and_leaves_nothing(home: Path, monkeypatch: pytest.MonkeyPatch):
    """The head's own start failing: its error, not a follow-up "no local cluster named" from the clean-up."""
    monkeypatch.setenv("RAYSLICE_HOME", str(home))

    def refuse(*args, **kwargs):
        raise OSError("ray: command not found")

    monkeypatch.setattr(local_cluster, "_launch", refuse)
    with pytest.raises(OSError, match="ray: command not found"):
        local_cluster.up(local_cluster.ClusterSpec(), name="broken")
    assert not (local_cluster.state_dir() / "broken.json").exists()


def test_free_ports_come_from_below_the_ephemeral_range():
    """Outgoing connections take ephemeral ports: a port `up` picks there can be gone before `ray start` binds it."""
    low = local_cluster._ephemeral_range_start()
    ports = [local_cluster.free_port() for _ in range(50)]
    assert all(1024 <= port < low for port in ports), ports
    assert len(set(ports)) > 40  # spread out, so two clusters starting at once rarely pick the same one


def test_a_worker_node_whose_raylet_died_is_started_again(home: Path, monkeypatch: pytest.MonkeyPatch):
    # Stand-ins for `ray start` sessions: one with its raylet, one whose raylet died while it waits.
    monkeypatch.setenv("RAYSLICE_HOME", str(home))
    raylet = home / "raylet"
    raylet.symlink_to("/bin/sleep")
    started: list[subprocess.Popen] = []

    def start(with_raylet: bool) -> int:
        command = f"{raylet} 60 & exec sleep 60" if with_raylet else "exec sleep 60"
        started.append(subprocess.Popen(["sh", "-c", command], start_new_session=True))
        return started[-1].pid

    relaunched: list[int] = []

    def relaunch(index: int) -> int:
        relaunched.append(index)
        return start(with_raylet=True)

    record = local_cluster.ClusterRecord(
        name="stand-in", gcs_address="", temp_dir=str(home),
        dashboard_url=f"http://127.0.0.1:{local_cluster.free_port()}",  # no dashboard: no node ever joins
        nodes=[local_cluster.NodeRecord(role="tpu", pid=start(with_raylet=True)),
               local_cluster.NodeRecord(role="tpu", pid=start(with_raylet=False))],
    )
    try:
        assert wait_until(lambda: started[0].pid in processes.sessions_running("raylet"), timeout=10)
        with pytest.raises(RaysliceError, match="only 0 of 2 Ray nodes joined"):
            local_cluster._wait_for_nodes(record, time.monotonic() + 3, relaunch)
        assert relaunched == [1]  # once: the new session has its raylet
        assert record.nodes[1].pid == started[2].pid and not processes.alive(started[1].pid)
        assert record.nodes[0].pid == started[0].pid and processes.alive(started[0].pid)
    finally:
        end_sessions(*started)
