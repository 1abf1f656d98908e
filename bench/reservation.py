"""Q1b: how long reserving a free slice takes on an idle cluster, against the placement groups alone.

From one long-lived driver on an idle private cluster (a v6e-4 and two v6e-16): rayslice's
`reserve_slices` (the heads group, then the hosts group pinned by label, with the node-table and
placement-group-table reads between them) and then its release; the same after taking a place in
the cluster's admission queue and being admitted (`rayslice.cluster.queue`, as the launcher does);
against creating and waiting for
the same two placement groups directly (same bundles, strategies and label selectors; the slice
names known in advance, so no reads between them), then removing them.

    .venv/bin/python bench/reservation.py [--reps 20]
"""

from __future__ import annotations

import time
from typing import Any

from _common import Report, Series, Table, cluster, driver, fmt_ratio, fmt_s, log, parse_args, stopwatch, wait_all_free

from rayslice.cluster import queue
from rayslice.cluster.reservation import (
    POD_TYPE_LABEL,
    SLICE_NAME_LABEL,
    WORKER_ID_LABEL,
    reserve_slices,
    wait_ready,
)
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.local import local_cluster

NAME = "reservation"
SPEC = local_cluster.ClusterSpec(tpus=("v6e-4", "v6e-16", "v6e-16"))
SHAPES = [("v6e-4 (1 host)", TpuSliceRequest(tpu="v6e-4")), ("v6e-16 (4 hosts)", TpuSliceRequest(tpu="v6e-16")),
          ("2 × v6e-16 (8 hosts)", TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True))]


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], default_reps=20)
    report = Report(NAME, args)
    table = Table("Reserving free slices on an idle cluster (median / p90 over n reps)",
                  ["shape", "n", "rayslice reserve_slices", "p90", "queue + reserve_slices", "p90",
                   "queue adds (median)", "× groups alone", "the two groups alone", "p90"])
    with cluster(SPEC, NAME) as record, driver(record) as ray:
        slices = {}
        for node in ray.nodes():
            labels = node.get("Labels", {})
            if node["Alive"] and labels.get(POD_TYPE_LABEL):
                slices.setdefault(labels[POD_TYPE_LABEL], set()).add(labels[SLICE_NAME_LABEL])
        for label, request in SHAPES:
            ours, alone, queued = Series(), Series(), Series()
            queue.snapshot()  # the broker started before the first recorded repetition
            names = sorted(slices[request.pod_type])[: request.num_slices]
            for rep in range(args.reps + 1):  # the first of each is not recorded
                wait_all_free(ray)
                with stopwatch() as took:
                    reservation = reserve_slices(request, timeout=60, name=f"bench-reservation-{rep}", queued=False)
                reservation.release()
                wait_all_free(ray)
                direct = _groups_alone(ray, request, names)
                wait_all_free(ray)
                with stopwatch() as with_queue:
                    reservation = reserve_slices(request, timeout=60, name=f"bench-reservation-q{rep}")  # queued
                reservation.release()  # leaves the queue
                if rep:
                    ours.add(took.s)
                    alone.add(direct)
                    queued.add(with_queue.s)
            log(f"{label}: rayslice {fmt_s(ours.median())}, with the queue {fmt_s(queued.median())}, "
                f"groups alone {fmt_s(alone.median())}")
            table.add(label, ours.n, fmt_s(ours.median()), fmt_s(ours.p90()), fmt_s(queued.median()),
                      fmt_s(queued.p90()), fmt_s(queued.median() - ours.median()),
                      fmt_ratio(ours.median(), alone.median()), fmt_s(alone.median()), fmt_s(alone.p90()))
    table.notes = [
        "rayslice: reserve_slices() from call to return (a ray.nodes() snapshot, the heads group created and "
        "ready, its table read, the hosts group created and ready, its table read); release not counted",
        "groups alone: the same two groups created one after the other, each waited for with ray.wait on its "
        "ready() ref; the slice names given, so no reads; removal not counted",
        "rayslice reserve_slices: queued=False, without the admission queue (as before it); queue + "
        "reserve_slices: the default, a place taken in the queue first (one call to the broker actor, which "
        "admits at once on an idle cluster, and a heartbeat thread started), from the call to the return; "
        "leaving the queue after release not counted",
        "every repetition starts with every TPU chip free; the first repetition of each shape is not recorded",
    ]
    report.add(table)
    report.write()


def _groups_alone(ray: Any, request: TpuSliceRequest, names: list[str]) -> float:
    from ray.util.placement_group import placement_group, remove_placement_group

    with stopwatch() as took:
        deadline = time.monotonic() + 60
        heads = placement_group([{request.head_resource: 1}] * request.num_slices, strategy="STRICT_SPREAD",
                                bundle_label_selector=[{POD_TYPE_LABEL: request.pod_type, WORKER_ID_LABEL: "0"}]
                                * request.num_slices)
        wait_ready(heads, deadline)
        plan = [(name, w) for name in names for w in range(request.hosts_per_slice)]
        hosts = placement_group([{"TPU": request.chips_per_host, "CPU": 1} for _ in plan], strategy="STRICT_SPREAD",
                                bundle_label_selector=[{SLICE_NAME_LABEL: n, WORKER_ID_LABEL: str(w),
                                                        POD_TYPE_LABEL: request.pod_type} for n, w in plan])
        wait_ready(hosts, deadline)
    remove_placement_group(hosts)
    remove_placement_group(heads)
    from ray.util.placement_group import placement_group_table

    while any(placement_group_table(g).get("state") not in ("REMOVED", None) for g in (hosts, heads)):
        time.sleep(0.01)  # gone before the next repetition reserves
    return took.s


if __name__ == "__main__":
    main()
