"""`rayslice doctor`'s look from inside the cluster: what only a Ray driver on the head can see.

Why a job: the doctor runs on the Airflow side, which speaks HTTP only, but the versions each node
runs, whether a host can write the checkpoint root, whether each node's metrics port answers, and
whether a host reaches the package index are facts of the nodes themselves. So the doctor submits
``python -m rayslice.cluster.doctor_probe '<json>'`` (the launcher's own code, shipped or installed)
and reads back one marked JSON line. The probe judges nothing: the doctor (rayslice/client/doctor.py)
decides what passes, so its rules are tested without a cluster.
"""

from __future__ import annotations

import json
import platform
import socket
import sys
import time
import urllib.request
import uuid
from typing import Any

#: The line the probe prints its facts on.
MARKER = "::rayslice-doctor::"
#: How long the nodes may take to answer (a node that does not is reported, not waited for). Generous: each node
#: may first start a worker process and unpack the job's shipped launcher, slow on a loaded or cold cluster.
NODE_TIMEOUT_S = 120.0


def _installed_rayslice() -> str | None:
    """The rayslice installed in this node's Python (None: only a shipped copy, or none)."""
    from importlib import metadata

    try:
        return metadata.version("rayslice")
    except metadata.PackageNotFoundError:
        return None


def node_facts(checkpoint_root: str | None, egress: list[str]) -> dict[str, Any]:
    """What one node's Python is: versions, and (when asked) checkpoint and egress attempts from it."""
    import ray

    import rayslice

    out: dict[str, Any] = {"node_id": ray.get_runtime_context().get_node_id(), "hostname": socket.gethostname(),
                           "python": platform.python_version(), "ray": ray.__version__,
                           "rayslice_imported": rayslice.__version__, "rayslice_installed": _installed_rayslice()}
    if checkpoint_root:
        out["checkpoint"] = _try_write(checkpoint_root)
    if egress:
        out["egress"] = {endpoint: _try_connect(endpoint) for endpoint in egress}
    return out


def _try_write(root: str) -> str | None:
    """Write, read back and remove one small file under ``root``; None when that worked, else why not."""
    try:
        import fsspec

        path = f"{root.rstrip('/')}/.rayslice-doctor/{uuid.uuid4().hex}"
        fs, inner = fsspec.core.url_to_fs(path)
        fs.makedirs(fs._parent(inner), exist_ok=True)  # as a step's checkpoint folder is made (a no-op on buckets)
        with fs.open(inner, "wb") as handle:
            handle.write(b"rayslice doctor")
        with fs.open(inner, "rb") as handle:
            if handle.read() != b"rayslice doctor":
                return "the file read back differs from what was written"
        fs.rm(inner)
        return None
    except Exception as exc:  # noqa: BLE001 - every failure is a fact to report
        return f"{type(exc).__name__}: {exc}"


def _try_connect(endpoint: str) -> str | None:
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return None
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _metrics(address: str, port: int | None) -> str | None:
    """None when ``http://address:port/metrics`` answers 200, as Prometheus would scrape it; else why not."""
    if not port:
        return "the node reports no metrics export port"
    try:
        with urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=5) as resp:  # noqa: S310
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


def metrics_errors(targets: list[tuple[str | None, int | None]]) -> list[str | None]:
    """``_metrics`` of every (address, port), asked at once.

    Why at once: a firewall that drops (not refuses) the port costs each ask its 5 s timeout; one after
    another, a large cluster's asks outlast the doctor's wait for the probe, and every other fact is lost.
    """
    from concurrent.futures import ThreadPoolExecutor

    if not targets:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(targets)), thread_name_prefix="rayslice-doctor-metrics") as pool:
        return list(pool.map(lambda target: _metrics(*target), targets))


def probe(checkpoint_root: str | None, egress: list[str]) -> dict[str, Any]:
    """Every alive node: its labels, resources, metrics port and the facts its own Python reports.

    One host (a TPU host if there is one, else any node that is not the head) also writes the
    checkpoint root and tries the egress endpoints: that is where a step would.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address="auto", log_to_driver=False)
    head = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    hosts = [n for n in nodes if n["NodeID"] != head]
    tpu_hosts = [n for n in hosts if (n.get("Resources") or {}).get("TPU")]
    writer = (tpu_hosts or hosts or nodes)[0]["NodeID"] if nodes else None
    remote = ray.remote(num_cpus=0)(node_facts)
    refs = {n["NodeID"]: remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(checkpoint_root if n["NodeID"] == writer else None, egress if n["NodeID"] == writer else [])
            for n in nodes}
    deadline = time.monotonic() + NODE_TIMEOUT_S
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=NODE_TIMEOUT_S)
    done = set(ready)
    out = []
    metrics = metrics_errors([(n.get("NodeManagerAddress"), n.get("MetricsExportPort")) for n in nodes])
    for n, metrics_error in zip(nodes, metrics, strict=True):
        entry: dict[str, Any] = {"node_id": n["NodeID"], "head": n["NodeID"] == head,
                                 "address": n.get("NodeManagerAddress"), "labels": n.get("Labels") or {},
                                 "resources": n.get("Resources") or {}, "writer": n["NodeID"] == writer,
                                 "metrics_port": n.get("MetricsExportPort"), "metrics_error": metrics_error}
        ref = refs[n["NodeID"]]
        if ref in done:
            try:
                entry |= ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001
                entry["error"] = f"{type(exc).__name__}: {exc}"
        else:
            ray.cancel(ref, force=True)
            entry["error"] = f"did not answer within {NODE_TIMEOUT_S:g} s"
        out.append(entry)
    return {"driver_python": platform.python_version(), "nodes": out}


def main(argv: list[str]) -> int:
    args = json.loads(argv[1]) if len(argv) > 1 else {}
    found = probe(args.get("checkpoint_root"), list(args.get("egress") or []))
    print(MARKER + json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))


def device_count() -> dict[str, Any]:
    """The doctor's smoke step, run on every host of one slice through the real launcher: JAX's view there.

    ``device_count`` is every device of the JAX group (the whole slice, once JAX is wired across its
    hosts); ``local_device_count`` this host's own.
    """
    import jax

    from rayslice.core.context import get_step_context

    ctx = get_step_context()
    return {"slice": ctx.slice_name, "worker": ctx.worker_id, "host": socket.gethostname(),
            "process_index": jax.process_index(), "device_count": jax.device_count(),
            "local_device_count": jax.local_device_count()}
