"""Issue 6: does giving a slice back let Ray's own autoscaler shrink, and does leaking it not?

Starts a cluster with no TPU hosts whose head runs Ray's autoscaler (v2) against Ray's fake
multi-node provider (`rayslice.local.local_autoscaler`), then prints one timeline per scenario:

1. rayslice `run_step` on a v6e-4 (one host): t=0 submit, host added, step running, step done,
   host removed.
2. the same on a v4-16 (2 hosts × 4 chips).
3. baseline: a long-lived driver that reserves a v6e-4 with `ray.util.tpu.SlicePlacementGroup`,
   runs on it with `run_on_slice`, and never removes the placement group (Ray's one-shot
   `run_on_slice()` keeps its worker group until the driver exits). The host must still be there
   idle-timeout + 30 s after the step; then the driver removes the group and the host goes.

    .venv/bin/python bench/autoscaling_timeline.py [--idle-minutes 0.2] [--pod-types v6e-4,v4-16] [--no-baseline]

The timelines are written to bench/results/autoscaling_timeline.md (`--no-write`: printed only).
"""

from __future__ import annotations

import time
from typing import Any

from _common import Report, Table, cluster, driver, log, parse_args

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import StepSpec
from rayslice.local import local_autoscaler

NAME = "autoscaling_timeline"

GRACE = 30.0  # removal must follow within idle timeout + GRACE seconds


def device_count_and_start() -> dict:
    import time

    import jax

    started = time.time()
    time.sleep(2)  # long enough to tell "running" from "done" on the timeline
    return {"devices": jax.device_count(), "started": started}


def timeline(title: str, rows: list[tuple[float, str]]) -> Table:
    table = Table(title, ["t (s)", "event"])
    for t, what in sorted(rows):
        table.add(f"{t:.1f}", what)
    return table


def node_rows(watcher: local_autoscaler.NodeWatcher, since: float) -> list[tuple[float, str]]:
    return [(e.t - since, f"node {e.kind}: {e.host}") for e in watcher.events if e.t >= since]


def rayslice_scenario(report: Report, watcher: local_autoscaler.NodeWatcher, pod_type: str, idle_s: float) -> dict:
    from rayslice.cluster import run_step

    request = TpuSliceRequest(tpu=pod_type)
    t0, wall0 = watcher.now(), time.time()
    results = run_step(StepSpec.for_function(device_count_and_start, request=request, capacity_timeout=240))
    done = watcher.now() - t0
    gone = watcher.wait(lambda alive: not alive, timeout=idle_s + GRACE + 30)
    rows = [
        (0.0, f"submit run_step({pod_type})"),
        (done, f"step done: devices per host {[r['devices'] for r in results]}"),
    ]
    rows += [
        (min(r["started"] for r in results) - wall0, "step function running (after the host process imported JAX)")
    ]
    rows += node_rows(watcher, t0)
    report.add(timeline(f"rayslice run_step on {pod_type} ({request.hosts_per_slice} host(s))", rows))
    removed = [e.t - t0 for e in watcher.events if e.t >= t0 and e.kind == "removed"]
    added = [e.t - t0 for e in watcher.events if e.t >= t0 and e.kind == "added"]
    after = max(removed) - done if gone and removed else None
    verdict = "ok" if after is not None and after <= idle_s + GRACE else "FAILED"
    report.note(
        f"{pod_type}: hosts added: {len(added)}, removed {after if after is None else round(after, 1)} s after the "
        f"step (bound: idle timeout {idle_s:.0f} s + {GRACE:.0f} s) -> {verdict}"
    )
    assert all(r["devices"] == request.chips_per_host * request.hosts_per_slice for r in results), results
    return {"added": len(added), "removed_after_s": after}


def leaky_baseline(report: Report, ray: Any, watcher: local_autoscaler.NodeWatcher, idle_s: float) -> dict:
    from ray.util.tpu import SlicePlacementGroup, run_on_slice

    @ray.remote
    def device_count() -> int:
        import jax

        return jax.device_count()

    t0 = watcher.now()
    handle = SlicePlacementGroup(
        topology="2x2", accelerator_version="v6e", bundle_label_selector=[{"ray.io/tpu-pod-type": "v6e-4"}]
    )
    devices = ray.get(run_on_slice(device_count, tpu_slice=handle))
    done = watcher.now() - t0
    held = watcher.wait(lambda alive: not alive, timeout=idle_s + GRACE)
    still = len(watcher.alive)
    checked = watcher.now() - t0
    handle.shutdown()  # now give it back: the autoscaler may shrink
    freed = watcher.now() - t0
    gone = watcher.wait(lambda alive: not alive, timeout=idle_s + GRACE + 30)
    rows = [
        (0.0, "submit SlicePlacementGroup(v6e 2x2) + run_on_slice (placement group never removed)"),
        (done, f"step done: jax.device_count() per host {devices} (no simulated-TPU setup: 1 CPU device)"),
        (checked, f"idle timeout + {GRACE:.0f} s later: {still} TPU host(s) still up"),
        (freed, "driver removes its placement group"),
    ]
    rows += node_rows(watcher, t0)
    report.add(timeline("baseline: leaked slice reservation", rows))
    verdict = "ok" if not held and still and gone else "FAILED"
    report.note(f"baseline: kept while leaked: {bool(not held and still)}; removed once released: {gone} -> {verdict}")
    return {"kept": bool(not held and still), "removed_after_release": gone}


def main() -> None:
    def options(parser: Any) -> None:
        parser.add_argument("--idle-minutes", type=float, default=0.2, help="autoscaler idle_timeout_minutes")
        parser.add_argument("--pod-types", default="v6e-4,v4-16",
                            help="rayslice scenarios, in order (default v6e-4,v4-16)")
        parser.add_argument("--no-baseline", action="store_true", help="skip the leaked-reservation baseline")

    args = parse_args(__doc__.splitlines()[0], extra=options, reps=False, attach=False)
    report = Report(NAME, args)
    pod_types = tuple(args.pod_types.split(","))
    if "v6e-4" not in pod_types:
        pod_types += ("v6e-4",)  # the baseline's node type
    idle_s = args.idle_minutes * 60
    log(f"head + autoscaler (node types: {', '.join(local_autoscaler.host_node_types(pod_types))})")

    def up(name: str) -> Any:
        return local_autoscaler.up(pod_types, name=name, idle_timeout_minutes=args.idle_minutes)

    with cluster(None, "bench-autoscaling", attempts=1, private=True, up=up) as record, driver(record) as ray:
        with local_autoscaler.NodeWatcher(record) as watcher:
            log(f"cluster up: {len(watcher.alive)} TPU hosts; idle timeout {idle_s:.0f} s")
            for pod_type in args.pod_types.split(","):
                rayslice_scenario(report, watcher, pod_type, idle_s)
            if not args.no_baseline:
                leaky_baseline(report, ray, watcher, idle_s)
    report.write()


if __name__ == "__main__":
    main()
