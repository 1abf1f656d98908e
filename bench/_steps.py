"""Step functions and the two hand-written baselines, shared by the benchmarks.

The step functions are shipped by value (cloudpickle), so they import what they need inside.
"""

from __future__ import annotations

import os
import time
from typing import Any

from _common import ROOT  # noqa: F401  (puts the repo root on sys.path)

from rayslice.core.accelerators import TpuSliceRequest


def trivial() -> dict[str, Any]:
    """The trivial step: when it started, and what this process already had (no JAX of its own)."""
    import os
    import sys
    import time

    now = time.time()
    return {"t": now, "pid": os.getpid(), "jax_loaded": "jax" in sys.modules, "proc_start": _proc_start()}


def jax_devices() -> dict[str, Any]:
    """The JAX variant: JAX ready on this host (its backend initialized across the group)."""
    import os
    import sys
    import time

    import jax

    devices = jax.device_count()
    return {
        "t": time.time(),
        "pid": os.getpid(),
        "devices": devices,
        "jax_loaded": "jax" in sys.modules,
        "proc_start": _proc_start(),
    }


def _proc_start() -> float:
    """Wall-clock start time of this process, from /proc (no psutil)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def now_and_return(seconds: float = 0.0) -> dict[str, Any]:
    """Runs `seconds`, then returns the time it finished and the Ray node it ran on (for release latency)."""
    import os
    import time

    import ray

    start = time.time()
    if seconds:
        time.sleep(seconds)
    node = ray.get_runtime_context().get_node_id()
    return {"start": start, "end": time.time(), "pid": os.getpid(), "node": node}


# ---------------------------------------------------------------------------------------------
# baseline (a): the hand-written, head-targeted pattern from Ray's TPU docs


def hand_written(ray: Any):
    """`run_on_pod` as in Ray's docs: a task on the slice head fans out one task per host."""

    @ray.remote
    def run_on_pod(fn: Any, hosts: int, chips: int, *args: Any) -> list[Any]:
        import ray as _ray

        name = _ray.util.tpu.get_current_pod_name()
        # get_current_pod_worker_count() is None on simulated nodes: the driver passes `hosts`.
        return _ray.get([fn.options(resources={name: 1, "TPU": chips}).remote(*args) for _ in range(hosts)])

    def run(fn: Any, request: TpuSliceRequest, *args: Any) -> Any:
        """Submit one head task per slice; returns the refs (one list of host results per slice)."""
        return [
            run_on_pod.options(resources={request.head_resource: 1}).remote(
                fn, request.hosts_per_slice, request.chips_per_host, *args
            )
            for _ in range(request.num_slices)
        ]

    return run


def flatten(per_slice: list[list[Any]]) -> list[Any]:
    return [host for hosts in per_slice for host in hosts]


# ---------------------------------------------------------------------------------------------
# baseline (b): ray.util.tpu.run_on_slice (Ray 2.60)


def run_on_slice_with_handle(ray: Any, remote_fn: Any, request: TpuSliceRequest, *args: Any) -> list[Any]:
    """Reserve with a slice handle, run on every host, get, then shut the handle down.

    The one-shot form (no handle) keeps its worker placement group until the driver exits,
    so in a long-lived driver the handle + shutdown() is the only way to repeat it.
    A single-host pod type gets a pod-type label selector: without it Ray's helper may pick
    one host of a bigger slice.
    """
    from ray.util.tpu import run_on_slice, slice_placement_group

    selector = [{"ray.io/tpu-pod-type": request.pod_type}] * request.total_hosts
    handle = slice_placement_group(
        topology=request.topology,
        accelerator_version=request.version,
        num_slices=request.num_slices,
        bundle_label_selector=selector if not request.is_multi_host else None,
    )
    try:
        return ray.get(run_on_slice(remote_fn, *args, tpu_slice=handle))
    finally:
        handle.shutdown()


def host_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("TPU_")}


def wall() -> float:
    return time.time()
