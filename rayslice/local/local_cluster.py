"""A local Ray cluster whose nodes look like TPU hosts and GPU machines to Ray's own detection.

Each simulated TPU host is a real `ray start` with the GKE TPU environment variables
(`TPU_NAME`, `TPU_WORKER_ID`, `TPU_ACCELERATOR_TYPE`, `TPU_TOPOLOGY`, `TPU_WORKER_HOSTNAMES`)
and `--resources '{"TPU": N}'`, so Ray itself adds the slice-name resource, the
`TPU-<pod type>-head` resource and the `ray.io/tpu-*` labels, exactly as on GKE.

Every node runs as `ray start --block` in its own process session. The state file records
each session's leader, and `down` ends exactly those sessions (plus any process still
naming this cluster's private temp dir): never `ray stop`, never another Ray.
"""

from __future__ import annotations

import functools
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from rayslice.core import launcher
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.context import CHECKPOINT_ROOT_ENV
from rayslice.core.exceptions import RaysliceError
from rayslice.local import processes

#: Every node advertises this loopback address. Not 127.0.0.1: Ray swaps that for the
#: machine's outward address, and a local cluster must only ever talk over loopback.
NODE_IP = "127.0.0.2"
_OBJECT_STORE_BYTES = 80 * 1024 * 1024
_HEAD_OBJECT_STORE_BYTES = 150 * 1024 * 1024

#: What an idle local cluster spends its CPU on, turned down (BENCHMARKS.md, "An idle local cluster's
#: CPU"). Every simulated host is a whole Ray node on the one machine, so Ray's per-node defaults add up:
#: - each node's dashboard agent collects and publishes the machine's stats (psutil over every process)
#:   every 5 s, and the dashboard head ingests each report; every 30 s is plenty for a laptop's dashboard
#:   (rayslice reads nodes from the state API, which these reports do not feed);
#: - the head's log monitor (the only one: nodes join without theirs) globs the logs folder for new worker
#:   files 10 times a second while it has fewer than 1,000 files; every 0.5 s instead (Ray's own pace past
#:   1,000, `LOG_NAME_UPDATE_INTERVAL_S`). A new worker's file is found at most that much later and read
#:   from its start, so no line is lost;
#: - each node's two agents check that their raylet still runs every 0.4 s; every 2 s (a node of a local
#:   cluster stops as one process session, so nothing waits on this). Ray reads it as a whole number;
#: - every node's dashboard agent, and the dashboard's event module, open every file of the session's
#:   events folder every 2 s to forward new events (worker deaths, job changes) to the dashboard's event
#:   page. On a real cluster each node has its own folder; here all nodes share the head's, which gains a
#:   file per worker process ever started, so each of the 12 readers reads every node's files and the cost
#:   grows all day (800 files: 5% of a core per agent). Every 60 s instead: an event reaches the
#:   dashboard's page up to a minute later; nothing in rayslice reads them.
IDLE_CPU_SETTINGS = {
    "REPORTER_UPDATE_INTERVAL_MS": "30000",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "RAY_DASHBOARD_AGENT_CHECK_PARENT_INTERVAL_S": "2",
    "SCAN_EVENT_DIR_INTERVAL_SECONDS": "60",
}


def state_dir() -> Path:
    """Where cluster records live (`RAYSLICE_HOME`, default `~/.rayslice`)."""
    return Path(os.environ.get("RAYSLICE_HOME", Path.home() / ".rayslice")) / "clusters"


def free_port() -> int:
    """A port nothing is bound to, below the kernel's ephemeral range.

    A port from `bind(0)` is an ephemeral one, which any outgoing connection on a busy machine can
    take before `ray start` binds it (a head whose Ray client server then dies of "Address already
    in use" takes the whole node down); below the range only explicit binders compete.
    """
    low = _ephemeral_range_start()
    for _ in range(100):
        port = random.randrange(max(1024, low - 12_000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # that whole band is in use: let the kernel choose
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_range_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


@dataclass
class NodeRecord:
    """One `ray start --block` process session we own."""

    role: str  # "head", "tpu", "gpu"
    pid: int
    slice_name: str | None = None
    worker_id: int | None = None
    pod_type: str | None = None
    args: list[str] = field(default_factory=list)  # how to start it again (`restart_node`), worker nodes only
    env: dict[str, str] = field(default_factory=dict)


def ray_connection(dashboard_url: str, token: str | None = None) -> dict:
    """The Airflow `ray` connection (JSON form) to a local cluster.

    Its nodes run this very Python environment, so rayslice is installed there: jobs need not
    ship the launcher (`launcher: installed`, see `hooks/ray.py`).
    """
    conn: dict = {"conn_type": "ray", "host": dashboard_url, "extra": {"launcher": "installed"}}
    if token:
        conn["password"] = token
    return conn


@dataclass
class ClusterRecord:
    name: str
    gcs_address: str
    dashboard_url: str
    temp_dir: str
    token: str | None = None
    nodes: list[NodeRecord] = field(default_factory=list)
    checkpoint_root: str = ""  # RAYSLICE_CHECKPOINT_ROOT on every node: where steps' checkpoint folders go
    python: str = ""  # the nodes' (so every worker's and job driver's) Python; "": the one running rayslice

    @property
    def path(self) -> Path:
        return state_dir() / f"{self.name}.json"

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(asdict(self), indent=2))
        self.path.chmod(0o600)  # may hold the cluster's token

    @classmethod
    def load(cls, name: str) -> ClusterRecord:
        path = state_dir() / f"{name}.json"
        if not path.exists():
            raise RaysliceError(f"no local cluster named {name!r} is recorded in {path.parent}")
        data = json.loads(path.read_text())
        data["nodes"] = [NodeRecord(**node) for node in data["nodes"]]
        return cls(**data)

    def driver_env(self) -> dict[str, str]:
        """What a user's shell needs to reach this cluster (`rayslice local env`): `ray.init()`,
        the README's examples and `dag.test()` connect with it and nothing else."""
        env = {
            "RAY_ADDRESS": self.gcs_address,  # ray.init() connects here instead of starting a Ray of its own
            # Explicit either way: with RAY_AUTH_MODE unset, Ray turns token auth on by itself when
            # ~/.ray/auth_token exists, and a token driver cannot start workers on a cluster without auth.
            "RAY_AUTH_MODE": "token" if self.token else "disabled",
            "RAYSLICE_DASHBOARD_URL": self.dashboard_url,
            "AIRFLOW_CONN_RAY_DEFAULT": json.dumps(ray_connection(self.dashboard_url, self.token)),
        }
        if self.token:
            env["RAY_AUTH_TOKEN"] = self.token
        if self.checkpoint_root:
            env[CHECKPOINT_ROOT_ENV] = self.checkpoint_root
        return env

    def ray_env(self) -> dict[str, str]:
        """Environment for anything that talks to this cluster (drivers, `ray` CLI)."""
        # Ten nodes starting at once on two cores need longer than Ray's default 10 s.
        env = {
            "RAY_raylet_start_wait_time_s": "180",
            "RAY_AUTH_MODE": "disabled",
            # A lost host is noticed in about 10 s (Ray's default is up to 45 s): a dead raylet
            # refuses the health check at once, so five misses two seconds apart suffice.
            "RAY_health_check_period_ms": "2000",
            "RAY_health_check_timeout_ms": "5000",
            "RAY_health_check_failure_threshold": "5",
            # A local cluster stops as a whole (`down`): a node that got SIGTERM after it ran steps
            # would otherwise wait for Ray's graceful drain (up to 30 s) before its processes exit.
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
            **IDLE_CPU_SETTINGS,
        }
        if self.token:  # explicit either way: Ray turns token auth on by itself if a token file exists
            env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}
        if self.checkpoint_root:  # every node's, and so every job driver's, default checkpoint root
            env[CHECKPOINT_ROOT_ENV] = self.checkpoint_root
        return env


@dataclass(frozen=True)
class ClusterSpec:
    """What to start: TPU slices by pod type, and one node with logical GPUs."""

    tpus: tuple[str, ...] = ()
    gpus: int = 0
    head_cpus: int = 2
    host_cpus: int = 2

    def slices(self) -> list[tuple[str, TpuSliceRequest]]:
        names: dict[str, int] = {}
        out = []
        for tpu in self.tpus:
            request = TpuSliceRequest(tpu=tpu)
            index = names.get(request.pod_type, 0)
            names[request.pod_type] = index + 1
            out.append((f"{request.pod_type}-{'abcdefghijklmnopqrstuvwxyz'[index % 26]}{index // 26 or ''}", request))
        return out


#: The cluster `rayslice demo` and `rayslice airflow up` start when none runs: two v6e-16, a v6e-4 and a
#: 3-GPU node, room for every example DAG at once. Here, not in demo.py, because both commands use it.
DEMO_SPEC = ClusterSpec(tpus=("v6e-16", "v6e-16", "v6e-4"), gpus=3)


def common_args() -> list[str]:
    """What every node of a local cluster starts with: its address, no usage stats, any worker ports, an agent port."""
    return ["--node-ip-address", NODE_IP, "--disable-usage-stats", "--min-worker-port", "0", "--max-worker-port", "0",
            "--dashboard-agent-listen-port", str(free_port())]


def head_args(gcs_port: int, dashboard_port: int, temp_dir: str, num_cpus: int,
              object_store_bytes: int = _HEAD_OBJECT_STORE_BYTES) -> list[str]:
    """`ray start` arguments of a local head (the dashboard on 127.0.0.1 only)."""
    return ["--head", "--port", str(gcs_port), "--dashboard-host", "127.0.0.1", "--dashboard-port",
            str(dashboard_port), "--ray-client-server-port", str(free_port()), "--temp-dir", temp_dir,
            "--num-cpus", str(num_cpus), "--object-store-memory", str(object_store_bytes), *common_args()]


def _ray_bin() -> str:
    candidate = Path(sys.executable).with_name("ray")
    return str(candidate) if candidate.exists() else "ray"


def check_python(python: str) -> str:
    """A Python the nodes can run: it imports ray and rayslice's cluster side (nothing of Airflow's is needed)."""
    path = Path(python).expanduser().absolute()  # not resolved: a venv's python is a symlink to its base
    if not path.is_file() or not os.access(path, os.X_OK):
        raise RaysliceError(f"--python {python}: no such executable")
    probe = subprocess.run([str(path), "-c", "import ray, rayslice.cluster, rayslice; print(rayslice.__version__)"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise RaysliceError(f"--python {python} cannot run the cluster side ({last}): install "
                            "'rayslice[cluster]' into it")
    return str(path)


@functools.cache
def launcher_label(python: str = "") -> list[str]:
    """`ray start --labels`: the digest of the launcher this Python has installed (`rayslice.core.launcher`).

    A job's shipped launcher with the same digest then starts its host processes here without
    Ray's `setup_worker` step. None when the Python lacks cloudpickle (nothing to match).
    """
    code = ("import cloudpickle, rayslice; from pathlib import Path; from rayslice.core import launcher; "
            "print(launcher.digest(Path(rayslice.__file__).parent, Path(cloudpickle.__file__).parent))")
    # From "/": what a node's worker imports, not a checkout that happens to be the current folder.
    probe = subprocess.run([python or sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    digest = probe.stdout.strip()
    return ["--labels", f"{launcher.LABEL}={digest}"] if probe.returncode == 0 and digest else []


def _command(python: str) -> list[str]:
    """How a node starts: this Python's `ray` script, or `<python> -m ray.scripts.scripts` for another Python."""
    return [python, "-m", "ray.scripts.scripts"] if python else [_ray_bin()]


def _launch(args: list[str], env: dict[str, str], log: Path, sockets: Path | None = None, python: str = "") -> int:
    """Start one node; with `sockets`, return only once its raylet has claimed a socket name.

    Nodes on one machine share the head's session dir and pick socket names by looking for
    a free one, so two nodes starting at the same moment can pick the same name and stall.
    """
    before = _raylet_sockets(sockets) if sockets else 0
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [*_command(python), "start", "--block", *args, *launcher_label(python)],
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # our own process group: `down` ends exactly this session
        )
    deadline = time.monotonic() + 120
    while sockets and _raylet_sockets(sockets) <= before and time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    return proc.pid


def _raylet_sockets(sockets: Path) -> int:
    return sum(1 for p in sockets.glob("raylet*"))


def alive_nodes(dashboard_url: str, token: str | None = None) -> list[dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(
        f"{dashboard_url}/api/v0/nodes", params={"detail": "1", "limit": "1000"}, headers=headers, timeout=10
    )
    response.raise_for_status()
    return [n for n in response.json()["data"]["result"]["result"] if n["state"] == "ALIVE"]


def up(spec: ClusterSpec, name: str = "default", token: str | None = None, timeout: float = 420,
       python: str | None = None) -> ClusterRecord:
    """Start a head plus one node per TPU host and one GPU node; return once all have joined.

    ``python``: the nodes run this Python (e.g. a venv with only ``rayslice[cluster]``) instead of the
    one running rayslice; Ray starts every worker and job driver with it.
    """
    if (state_dir() / f"{name}.json").exists():
        raise RaysliceError(
            f"a local cluster named {name!r} is already recorded; run `rayslice local down --name {name}` first"
        )
    gcs_port, dashboard_port = free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="rs-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    record = ClusterRecord(
        name=name,
        gcs_address=f"{NODE_IP}:{gcs_port}",
        dashboard_url=f"http://127.0.0.1:{dashboard_port}",
        temp_dir=temp_dir,
        token=token,
        python=check_python(python) if python else "",
    )
    # Job drivers run `python`: make it this interpreter, which has ray and jax. Every simulated
    # host reaches the same local folder, so it is the cluster's default checkpoint root.
    record.checkpoint_root = f"file://{state_dir().parent / 'checkpoints' / name}"
    bin_dir = Path(record.python).parent if record.python else Path(sys.executable).parent
    env = record.ray_env() | {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = state_dir() / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    sockets = Path(temp_dir) / "session_latest" / "sockets"
    deadline = time.monotonic() + timeout
    try:
        head = _launch(head_args(gcs_port, dashboard_port, temp_dir, spec.head_cpus), env, log, python=record.python)
        record.nodes.append(NodeRecord(role="head", pid=head))
        record.save()
        # Raylets that join before the head has registered itself stall until they time out.
        _wait_for_nodes(record, deadline)
        # All nodes share the head's session folder, so one log monitor (the head's) already streams
        # every worker's output; a monitor per node would publish each line once per node.
        join = [
            "--address",
            record.gcs_address,
            "--object-store-memory",
            str(_OBJECT_STORE_BYTES),
            "--include-log-monitor=false",
        ]
        for slice_name, request in spec.slices():
            hostnames = ",".join(["127.0.0.1"] * request.hosts_per_slice)
            for worker_id in range(request.hosts_per_slice):
                tpu_env = env | {
                    "TPU_NAME": slice_name,
                    "TPU_WORKER_ID": str(worker_id),
                    "TPU_ACCELERATOR_TYPE": request.pod_type,
                    "TPU_TOPOLOGY": request.topology,
                    "TPU_WORKER_HOSTNAMES": hostnames,
                }
                args = [
                    *join,
                    *common_args(),
                    "--num-cpus",
                    str(spec.host_cpus),
                    "--resources",
                    json.dumps({"TPU": request.chips_per_host}),
                ]
                pid = _launch(args, tpu_env, log, sockets, record.python)
                record.nodes.append(
                    NodeRecord(
                        role="tpu",
                        pid=pid,
                        slice_name=slice_name,
                        worker_id=worker_id,
                        pod_type=request.pod_type,
                        args=args,
                        env=tpu_env,
                    )
                )
        if spec.gpus:
            args = [*join, *common_args(), "--num-cpus", "4", "--num-gpus", str(spec.gpus)]
            record.nodes.append(NodeRecord(role="gpu", pid=_launch(args, env, log, sockets, record.python),
                                           args=args, env=env))
        record.save()

        def relaunch(index: int) -> int:
            return _launch(record.nodes[index].args, record.nodes[index].env, log, sockets, record.python)

        _wait_for_nodes(record, deadline, relaunch)
    except BaseException:
        stop(record)  # the record in hand: one that failed before it was saved stops too
        raise
    return record


def kill_node(record: ClusterRecord, index: int) -> None:
    """SIGKILL every process of one worker node's session at once, as a preempted VM vanishes."""
    node = record.nodes[index]
    if node.role == "head":
        raise RaysliceError("the head is not a host: kill a TPU or GPU node")
    _kill_session(node.pid)


def slice_nodes(record: ClusterRecord, slice_name: str, workers: list[int] | None = None) -> dict[int, str]:
    """The recorded nodes of one slice (all its hosts, or those `workers`): record index -> Ray node id (hex)."""
    slices = sorted({n.slice_name for n in record.nodes if n.slice_name})
    indexes = [i for i, n in enumerate(record.nodes) if n.slice_name == slice_name]
    if not indexes:
        raise RaysliceError(f"cluster {record.name!r} has no slice {slice_name!r}; its slices: {', '.join(slices)}")
    if workers is not None:
        hosts = {record.nodes[i].worker_id for i in indexes}
        if unknown := sorted(set(workers) - hosts):
            raise RaysliceError(f"slice {slice_name!r} has no worker {', '.join(map(str, unknown))}: its workers are "
                                f"{', '.join(str(w) for w in sorted(hosts))}")
        indexes = [i for i in indexes if record.nodes[i].worker_id in workers]
    ids = {}
    for node in alive_nodes(record.dashboard_url, record.token):
        labels = node.get("labels") or {}
        if labels.get("ray.io/tpu-slice-name") == slice_name:
            for i in indexes:
                if str(record.nodes[i].worker_id) == str(labels.get("ray.io/tpu-worker-id")):
                    ids[i] = node["node_id"]
    if missing := [i for i in indexes if i not in ids]:
        workers_missing = ", ".join(str(record.nodes[i].worker_id) for i in missing)
        raise RaysliceError(f"slice {slice_name!r}: worker(s) {workers_missing} are not alive in Ray "
                            "(already preempted?)")
    return ids


def drain(record: ClusterRecord, node_ids: list[str], seconds: float, message: str = "") -> float:
    """Send Ray's preemption notice for these nodes, as a platform's autoscaler does; returns the deadline (epoch s).

    `DrainNode` with reason preemption and a deadline `seconds` ahead: the GCS lists the nodes as
    draining with that deadline, schedules nothing new on them, and kills nothing (`preempt` does).
    """
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    deadline = time.time() + seconds
    auth = {k: v for k, v in record.ray_env().items() if k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    with processes.environ_overlaid(auth):
        client = GcsClient(address=record.gcs_address)
        for node_id in node_ids:
            accepted, why = client.drain_node(node_id, autoscaler_pb2.DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION,
                                              message or f"rayslice local preempt: {seconds:.0f} s notice",
                                              int(deadline * 1000))
            if not accepted:
                raise RaysliceError(f"Ray refused to drain node {node_id}: {why}")
    return deadline


def preempt(record: ClusterRecord, slice_name: str, seconds: float, workers: list[int] | None = None,
            kill: bool = True) -> dict[int, str]:
    """A platform's preemption of a slice: its hosts' nodes drained with a deadline `seconds` ahead, then killed.

    Blocks until the deadline. A node whose raylet already exited (Ray ends a drained node once it
    is idle) is only made sure of. Returns the record indexes and node ids that were preempted.
    """
    if seconds < 0:
        raise RaysliceError(f"--in must be 0 s or more, got {seconds}")
    nodes = slice_nodes(record, slice_name, workers)
    deadline = drain(record, list(nodes.values()), seconds)
    if kill:
        time.sleep(max(0.0, deadline - time.time()))
        for index in nodes:
            if processes.alive(record.nodes[index].pid):
                kill_node(record, index)
    return nodes


def restart_node(record: ClusterRecord, index: int, timeout: float = 180) -> None:
    """Start a killed worker node again with its own TPU identity (a replaced VM); wait until it joins."""
    node = record.nodes[index]
    if not node.args:
        raise RaysliceError(f"node {index} of {record.name!r} has no recorded start command")
    gone_by = time.monotonic() + 10  # a node killed just now may take a moment to exit
    while processes.alive(node.pid) and time.monotonic() < gone_by:
        time.sleep(0.1)
    if processes.alive(node.pid):
        raise RaysliceError(f"node {index} of {record.name!r} is still running (pid {node.pid})")
    sockets = Path(record.temp_dir) / "session_latest" / "sockets"

    def relaunch(i: int) -> int:
        if i != index:
            raise RaysliceError(f"node {i} of {record.name!r} is down too; restart_node starts node {index} only")
        return _launch(node.args, node.env, state_dir() / f"{record.name}.log", sockets, record.python)

    node.pid = relaunch(index)
    record.save()
    _wait_for_nodes(record, time.monotonic() + timeout, relaunch)


def _wait_for_nodes(record: ClusterRecord, deadline: float, relaunch=None, attempts: int = 2) -> None:
    """Wait until every recorded node has joined; restart a worker node whose `ray start` gave up.

    On a loaded two-core machine a raylet can miss its registration deadline, or abort when its
    dashboard agent takes longer than Ray allows to publish its ports (about 17 s; seen at 20 s
    with both cores saturated); a second try then usually joins. A worker node's raylet exists
    once `_launch` returns, so a node whose `ray start` runs on without one has failed: `ray start`
    itself only notices minutes later. The head is never restarted.
    """
    expected = len(record.nodes)
    seen = 0
    retries = dict.fromkeys(range(len(record.nodes)), attempts)
    while time.monotonic() < deadline:
        with_raylet = processes.sessions_running("raylet")
        for index, node in enumerate(record.nodes):
            if processes.alive(node.pid) and (node.role == "head" or node.pid in with_raylet):
                continue
            if relaunch is None or node.role == "head" or retries[index] == 0:
                raise RaysliceError(
                    f"ray start exited early (pid {node.pid}); see {state_dir() / (record.name + '.log')}"
                )
            retries[index] -= 1
            _kill_session(node.pid)  # a half-started raylet must not join late as a duplicate host
            node.pid = relaunch(index)
            record.save()
        try:
            seen = len(alive_nodes(record.dashboard_url, record.token))
            if seen >= expected:
                return
        except httpx.HTTPError:
            pass  # the dashboard comes up after the GCS
        time.sleep(1)
    raise RaysliceError(
        f"only {seen} of {expected} Ray nodes joined in time; see {state_dir() / (record.name + '.log')}"
    )


def owned_pids(record: ClusterRecord) -> set[int]:
    """Every live process of this cluster: our sessions, and anything naming our temp dir."""
    return processes.session_members({n.pid for n in record.nodes}, naming=record.temp_dir)


def down(name: str = "default", grace: float = 10) -> int:
    """Stop every process this cluster started; returns how many were running."""
    return stop(ClusterRecord.load(name), grace)


def stop(record: ClusterRecord, grace: float = 10) -> int:
    """Stop every process of `record` (its nodes, and anything naming its temp dir) and forget it."""
    pids = owned_pids(record)
    for node in record.nodes:  # `ray start --block` stops its own children on SIGTERM
        processes.send_signal(node.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and owned_pids(record):
        time.sleep(0.2)
    for pid in owned_pids(record):
        processes.send_signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and owned_pids(record):
        time.sleep(0.1)
    left = owned_pids(record)
    if left:
        raise RaysliceError(f"processes {sorted(left)} of cluster {record.name!r} did not exit")
    record.path.unlink(missing_ok=True)
    subprocess.run(["rm", "-rf", record.temp_dir], check=False)
    return len(pids)


def _kill_session(session: int) -> None:
    for pid in processes.session_members({session}):
        processes.send_signal(pid, signal.SIGKILL)


def new_token() -> str:
    return secrets.token_hex(24)
