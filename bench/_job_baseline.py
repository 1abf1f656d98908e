"""The baselines as Ray job drivers (bench/dispatch.py submits this file as a Ray job).

    python _job_baseline.py a|b|a-nojax|b-nojax <json: head_resource, hosts, chips, num_slices, multislice,
                                                       topology, version, pod_type, slice_names>

(a) the hand-written head-targeted pattern of Ray's TPU docs: one task on each slice's
`TPU-<type>-head` that launches one task per host with `{<slice name>: 1, "TPU": <chips>}`;
(b) `ray.util.tpu.run_on_slice`, one-shot (a job driver is short-lived, so its placement group
goes when the driver exits); for a single-host pod type through a slice handle, the only form
that takes the pod-type label selector.

Without `-nojax`, every host does what a JAX step on a slice needs, as rayslice's hosts do:
set JAX's environment, import JAX and join one `jax.distributed` group over gloo (one group
per slice, or one for the whole multislice job), then the step (`jax.device_count()`). The
coordinator is process 0's host; its port is chosen by this driver (every simulated host is
this machine), which spares the baselines a round trip that a real cluster would need.

The result is printed as rayslice's own result line, so the benchmark follows these jobs
with exactly the follower it uses for rayslice's. Self-contained (only `ray`, `jax`).
"""

from __future__ import annotations

import json
import socket
import sys

RESULT_MARKER = "::rayslice-result::"


def trivial() -> dict:
    """The JAX-free step: when it started, and when its process started."""
    import os
    import sys
    import time

    now = time.time()
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return {"t": now, "pid": os.getpid(), "jax_loaded": "jax" in sys.modules, "proc_start": time.time() - age}


def jax_host(coordinator: str, num_processes: int, slice_index: int, hosts: int, chips: int) -> dict:
    """One host of a JAX gang on a simulated slice, wired by hand (cf. rayslice's SimulatedTpuSlice)."""
    import os
    import sys

    jax_loaded = "jax" in sys.modules
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={chips}"
    import jax

    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=slice_index * hosts + int(os.environ["TPU_WORKER_ID"]),
            local_device_ids=list(range(chips)),
            cluster_detection_method="deactivate",
            initialization_timeout=120,
        )
    devices = jax.device_count()
    result = trivial() | {"devices": devices, "jax_loaded": jax_loaded}
    if num_processes > 1:
        jax.distributed.shutdown()
    return result


def run_on_slice_host(coordinator: str, num_processes: int, slice_names: list[str], hosts: int, chips: int) -> dict:
    """(b)'s host: run_on_slice gives every host the same arguments, so it finds its slice itself."""
    import ray as _ray

    name = _ray.util.tpu.get_current_pod_name()
    index = slice_names.index(name) if num_processes > hosts else 0
    return jax_host(coordinator, num_processes, index, hosts, chips)


def free_port() -> int:
    with socket.socket() as sock:  # simulation only: every host is this machine (127.0.0.2)
        sock.bind(("127.0.0.2", 0))
        return sock.getsockname()[1]


def main() -> None:
    import ray

    method, shape = sys.argv[1], json.loads(sys.argv[2])
    ray.init(logging_level="ERROR", log_to_driver=False)
    use_jax = not method.endswith("-nojax")
    hosts, chips, num_slices = shape["hosts"], shape["chips"], shape["num_slices"]
    processes = hosts * num_slices if shape["multislice"] else hosts
    coordinator = f"127.0.0.2:{free_port()}" if use_jax and processes > 1 else ""
    if method.startswith("a"):
        step = ray.remote(jax_host if use_jax else trivial)

        @ray.remote
        def run_on_pod(fn, slice_names: list[str]) -> list:
            import ray as _ray

            name = _ray.util.tpu.get_current_pod_name()
            index = slice_names.index(name) if processes > hosts else 0
            args = (coordinator, processes, index, hosts, chips) if use_jax else ()
            return _ray.get([fn.options(resources={name: 1, "TPU": chips}).remote(*args) for _ in range(hosts)])

        refs = [run_on_pod.options(resources={shape["head_resource"]: 1}).remote(step, shape["slice_names"])
                for _ in range(num_slices)]
        results = [h for per_slice in ray.get(refs) for h in per_slice]
    else:
        from ray.util.tpu import run_on_slice, slice_placement_group

        step = ray.remote(run_on_slice_host if use_jax else trivial)
        args = (coordinator, processes, shape["slice_names"], hosts, chips) if use_jax else ()
        if hosts > 1:  # one-shot: the job driver is short-lived, its placement group goes with it
            results = ray.get(run_on_slice(step, *args, topology=shape["topology"],
                                           accelerator_version=shape["version"], num_slices=num_slices))
        else:
            # A single-host pod type needs its pod-type label, which only the handle form takes: without
            # it Ray's helper may take one host of a bigger slice of the same generation.
            handle = slice_placement_group(
                topology=shape["topology"], accelerator_version=shape["version"], num_slices=num_slices,
                bundle_label_selector=[{"ray.io/tpu-pod-type": shape["pod_type"]}] * num_slices)
            results = ray.get(run_on_slice(step, *args, tpu_slice=handle))
    print(RESULT_MARKER + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
