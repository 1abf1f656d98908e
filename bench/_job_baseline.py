"""The two baselines as Ray job drivers (bench/dispatch_overhead.py submits this file as a Ray job).

    python _job_baseline.py a|b <json: head_resource, hosts, chips, num_slices, topology, version, pod_type>

(a) the hand-written head-targeted pattern of Ray's TPU docs: one task on each slice's
`TPU-<type>-head` that launches one task per host with `{<slice name>: 1, "TPU": <chips>}`;
(b) `ray.util.tpu.run_on_slice`, one-shot (a job driver is short-lived, so its placement group
goes when the driver exits); for a single-host pod type through a slice handle, the only form
that takes the pod-type label selector. The last log line is `::bench-result::<json host results>`.
Self-contained (only `ray`), so it ships as a one-file working_dir.
"""

from __future__ import annotations

import json
import sys


def trivial() -> dict:
    """The trivial step: when it started, and when its process started (as bench/_steps.py's)."""
    import os
    import sys
    import time

    now = time.time()
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return {"t": now, "pid": os.getpid(), "jax_loaded": "jax" in sys.modules,
            "proc_start": btime + ticks / os.sysconf("SC_CLK_TCK")}


def main() -> None:
    import ray

    method, shape = sys.argv[1], json.loads(sys.argv[2])
    ray.init(logging_level="ERROR", log_to_driver=False)
    step = ray.remote(trivial)
    if method == "a":

        @ray.remote
        def run_on_pod(fn, hosts: int, chips: int) -> list:
            import ray as _ray

            name = _ray.util.tpu.get_current_pod_name()
            return _ray.get([fn.options(resources={name: 1, "TPU": chips}).remote() for _ in range(hosts)])

        refs = [run_on_pod.options(resources={shape["head_resource"]: 1}).remote(step, shape["hosts"], shape["chips"])
                for _ in range(shape["num_slices"])]
        hosts = [h for per_slice in ray.get(refs) for h in per_slice]
    else:
        from ray.util.tpu import run_on_slice, slice_placement_group

        if shape["hosts"] > 1:  # one-shot: the job driver is short-lived, its placement group goes with it
            hosts = ray.get(run_on_slice(step, topology=shape["topology"], accelerator_version=shape["version"],
                                         num_slices=shape["num_slices"]))
        else:
            # A single-host pod type needs its pod-type label, which only the handle form takes: without
            # it Ray's helper may take one host of a bigger slice of the same generation.
            handle = slice_placement_group(
                topology=shape["topology"], accelerator_version=shape["version"], num_slices=shape["num_slices"],
                bundle_label_selector=[{"ray.io/tpu-pod-type": shape["pod_type"]}] * shape["num_slices"])
            hosts = ray.get(run_on_slice(step, tpu_slice=handle))
    print("::bench-result::" + json.dumps(hosts), flush=True)


if __name__ == "__main__":
    main()
