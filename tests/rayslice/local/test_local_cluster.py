"""`rayslice local up/down`: real `ray start` processes, stopped by PID, never anyone else's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rayslice.local import local_cluster, processes

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



def test_free_ports_come_from_below_the_ephemeral_range():
    """Outgoing connections take ephemeral ports: a port `up` picks there can be gone before `ray start` binds it."""
    low = local_cluster._ephemeral_range_start()
    ports = [local_cluster.free_port() for _ in range(50)]
    assert all(1024 <= port < low for port in ports), ports
    assert len(set(ports)) > 40  # spread out, so two clusters starting at once rarely pick the same one
