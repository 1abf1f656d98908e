"""A local Ray cluster that starts with no TPU hosts and lets Ray's own autoscaler add and remove them.

The head runs Ray's autoscaler (v2) against Ray's `FakeMultiNodeProvider`, which starts each
"cloud instance" as a local raylet (`rayslice.local.fake_tpu_provider` adds a per-type `TPU_NAME`).
No GKE TPU variables reach those raylets, so Ray's TPU detection adds nothing: every TPU host
type carries, in the node-type config, what detection would give it on GKE: the `TPU`,
`TPU-<pod type>-head` (worker 0 only), slice-name and `accelerator_type:` resources, and the
`ray.io/tpu-*` labels. A node type is one node with static labels, so a multi-host slice is
one node type per worker id (`max_workers: 1` each), all naming the same slice.

The provider is named as `type: external` (the installed wheel lacks the defaults file that
`type: fake_multinode` loads). The record is a normal `local_cluster.ClusterRecord`, so
`local_cluster.down(name)` stops it by PID like any other. Nodes advertise the machine's
address, not 127.0.0.2: the fake provider has no node-IP setting.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.exceptions import RaysliceError
from rayslice.local import local_cluster, processes
from rayslice.local.local_cluster import NODE_IP, ClusterRecord, NodeRecord

PROVIDER = "rayslice.local.fake_tpu_provider.FakeTpuHostProvider"
#: The fake provider's head node id; autoscaler v2 matches the head's instance by it.
FAKE_HEAD_NODE_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"
HEAD_TYPE = "ray.head.default"


def host_node_types(pod_types: tuple[str, ...], host_cpus: int = 1) -> dict[str, dict]:
    """One autoscaler node type per TPU host (slice `<pod type>-a`, worker id `i`), min 0, max 1."""
    types: dict[str, dict] = {}
    for pod_type in pod_types:
        request = TpuSliceRequest(tpu=pod_type)
        slice_name = f"{request.pod_type}-a"
        for worker_id in range(request.hosts_per_slice):
            resources = {
                "CPU": host_cpus,
                "object_store_memory": 80 * 1024 * 1024,
                "TPU": request.chips_per_host,
                slice_name: 1,
                f"accelerator_type:TPU-{request.version.upper()}": 1,
            }
            if worker_id == 0:
                resources[request.head_resource] = 1
            name = request.pod_type if request.hosts_per_slice == 1 else f"{request.pod_type}-w{worker_id}"
            types[name] = {
                "resources": resources,
                "labels": {
                    "ray.io/tpu-pod-type": request.pod_type,
                    "ray.io/tpu-slice-name": slice_name,
                    "ray.io/tpu-worker-id": str(worker_id),
                    "ray.io/tpu-topology": request.topology,
                    "ray.io/accelerator-type": f"TPU-{request.version.upper()}",
                },
                # Ray's multi-host reservation reads the slice name from TPU_NAME on worker 0.
                "node_config": {"env": {"TPU_NAME": slice_name}},
                "min_workers": 0,
                "max_workers": 1,
            }
    return types


def autoscaling_config(
    name: str, gcs_address: str, pod_types: tuple[str, ...], idle_timeout_minutes: float, head_cpus: int
) -> dict:
    workers = host_node_types(pod_types)
    return {
        "cluster_name": name,
        "max_workers": len(workers),
        "upscaling_speed": 10.0,
        "idle_timeout_minutes": idle_timeout_minutes,
        "provider": {
            "type": "external",
            "module": PROVIDER,
            "gcs_address": gcs_address,
            "head_node_id": FAKE_HEAD_NODE_ID,
            "launch_multiple": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "auth": {"ssh_user": "ray"},
        # prepare_config() expects every key of a full cluster YAML; nothing is run on the fake nodes.
        **dict.fromkeys(
            (
                "initialization_commands",
                "setup_commands",
                "head_setup_commands",
                "worker_setup_commands",
                "head_start_ray_commands",
                "worker_start_ray_commands",
                "cluster_synced_files",
                "rsync_exclude",
                "rsync_filter",
            ),
            [],
        ),
        "file_mounts": {},
        "file_mounts_sync_continuously": False,
        "head_node_type": HEAD_TYPE,
        "available_node_types": {
            HEAD_TYPE: {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0},
            **workers,
        },
    }


def up(
    pod_types: tuple[str, ...],
    name: str,
    idle_timeout_minutes: float = 0.3,
    head_cpus: int = 1,
    timeout: float = 180,
) -> ClusterRecord:
    """Start the head (with the autoscaler) and return once it has joined; no TPU host runs yet."""
    if (local_cluster.state_dir() / f"{name}.json").exists():
        raise RaysliceError(f"a local cluster named {name!r} is already recorded")
    gcs_port, dashboard_port = local_cluster.free_port(), local_cluster.free_port()
    temp_dir = tempfile.mkdtemp(prefix="rsa-", dir="/tmp")
    record = ClusterRecord(
        name=name,
        gcs_address=f"{NODE_IP}:{gcs_port}",
        dashboard_url=f"http://127.0.0.1:{dashboard_port}",
        temp_dir=temp_dir,
    )
    config_path = Path(temp_dir) / "autoscaling.json"
    config_path.write_text(
        json.dumps(autoscaling_config(name, record.gcs_address, pod_types, idle_timeout_minutes, head_cpus))
    )
    env = record.ray_env() | {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_FAKE_CLUSTER": "1",
        "AUTOSCALER_UPDATE_INTERVAL_S": "1",
        "AUTOSCALER_METRIC_PORT": str(local_cluster.free_port()),  # the default 44217 may be another cluster's
        "RAY_enable_autoscaler_v2": "1",
        "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
        "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID,
    }
    log = local_cluster.state_dir() / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    args = [*local_cluster.head_args(gcs_port, dashboard_port, temp_dir, head_cpus),
            "--autoscaling-config", str(config_path)]
    try:
        record.nodes.append(NodeRecord(role="head", pid=local_cluster._launch(args, env, log)))
        record.save()
        _wait_for_head(record, time.monotonic() + timeout)
        report_node_groups(record, host_node_types(pod_types))
    except BaseException:
        local_cluster.down(name)
        raise
    return record


_REPORT = """
import sys
from ray._raylet import GcsClient, GCS_AUTOSCALER_CLUSTER_CONFIG_KEY, GCS_AUTOSCALER_STATE_NAMESPACE
GcsClient(sys.argv[1]).internal_kv_put(GCS_AUTOSCALER_CLUSTER_CONFIG_KEY.encode(), sys.stdin.buffer.read(),
                                               True, GCS_AUTOSCALER_STATE_NAMESPACE.encode())
"""


def report_node_groups(record: ClusterRecord, types: dict[str, dict]) -> None:
    """Tell the GCS the autoscaler's node groups and their maxima, as platforms do (Ray's ReportClusterConfig).

    Ray 2.60's own autoscaler does not, and without them nothing on the cluster can tell a slice type
    that may be added from one that never will (the queue, `check_satisfiable`). What the GCS's
    ReportClusterConfig handler stores: a `ClusterConfig` in its internal key-value store.
    """
    import subprocess

    from ray.core.generated import autoscaler_pb2

    config = autoscaler_pb2.ClusterConfig()
    for name, node_type in types.items():
        group = config.node_group_configs.add(name=name, min_count=node_type["min_workers"],
                                              max_count=node_type["max_workers"])
        for resource, amount in node_type["resources"].items():
            if resource != "object_store_memory":
                group.resources[resource] = int(amount)
    env = {**os.environ, **record.ray_env()}
    done = subprocess.run([sys.executable, "-c", _REPORT, record.gcs_address], input=config.SerializeToString(),
                          env=env, timeout=120, capture_output=True)
    if done.returncode:
        raise RaysliceError(f"could not report the node groups of {record.name!r} to its GCS: "
                            f"{done.stderr.decode(errors='replace')[-2000:]}")


def _wait_for_head(record: ClusterRecord, deadline: float) -> None:
    """Until the autoscaler has found the head: before that it has not reported to the GCS."""
    monitor_log = Path(record.temp_dir) / "session_latest" / "logs" / "monitor.log"
    while time.monotonic() < deadline:
        if not processes.alive(record.nodes[0].pid):
            raise RaysliceError(f"ray start exited early; see {local_cluster.state_dir() / (record.name + '.log')}")
        lines = monitor_log.read_text().splitlines() if monitor_log.exists() else []
        if any("->RAY_RUNNING" in line and f"type={HEAD_TYPE}" in line for line in lines):
            return
        time.sleep(1)
    raise RaysliceError(f"the head of {record.name!r} or its autoscaler did not come up in time; see {monitor_log}")


def tpu_nodes(record: ClusterRecord) -> list[dict]:
    """The alive TPU hosts, as the dashboard's state API reports them (with their labels)."""
    return [
        node
        for node in local_cluster.alive_nodes(record.dashboard_url, record.token)
        if "ray.io/tpu-pod-type" in (node.get("labels") or {})
    ]


@dataclass
class NodeEvent:
    t: float  # seconds since the watcher started
    kind: str  # "added" or "removed"
    node_id: str
    labels: dict[str, str]

    @property
    def host(self) -> str:
        return f"{self.labels.get('ray.io/tpu-slice-name')}/host{self.labels.get('ray.io/tpu-worker-id')}"


@dataclass
class NodeWatcher:
    """Polls the dashboard for TPU hosts joining and leaving; no `ray` import, so any process can watch."""

    record: ClusterRecord
    interval: float = 0.25
    events: list[NodeEvent] = field(default_factory=list)
    alive: dict[str, dict] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> NodeWatcher:
        self.poll()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def now(self) -> float:
        return time.monotonic() - self.started

    def poll(self) -> None:
        try:
            nodes = {n["node_id"]: n.get("labels") or {} for n in tpu_nodes(self.record)}
        except httpx.HTTPError:
            return
        t = self.now()
        for node_id, labels in nodes.items():
            if node_id not in self.alive:
                self.events.append(NodeEvent(t, "added", node_id, labels))
        for node_id, labels in self.alive.items():
            if node_id not in nodes:
                self.events.append(NodeEvent(t, "removed", node_id, labels))
        self.alive = nodes

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def wait(self, condition, timeout: float) -> bool:
        """Until `condition(alive)` holds (True) or `timeout` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition(self.alive):
                return True
            time.sleep(self.interval)
        return bool(condition(self.alive))
