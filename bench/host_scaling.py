"""Q3: dispatch time (submission to the step running on every host) for 1 to 16 hosts.

Every simulated host is a full Ray node (a raylet, its agents, its workers), so the sizes run
where they fit. With `--cluster dev` (the shared cluster: a v6e-4 and two v6e-16) it measures
1 host (v6e-4), 4 hosts (v6e-16) and 8 hosts (2× v6e-16 as one multislice gang: 8 host
processes, one JAX job) there; `--private 2,16` adds a private cluster with those slice sizes
(v4-16: 2 hosts × 4 chips, v6e-64: 16 hosts), started and stopped by this script. Without
`--cluster`, every size runs on private clusters (1+2+8 hosts, then 4+16). Rows: rayslice
`run_step` with the trivial step, and the hand-written head-targeted tasks (a) for reference.

    RAYSLICE_HOME=/tmp/rs-dev-home .venv/bin/python bench/host_scaling.py --cluster dev [--reps 10]
    RAYSLICE_HOME=/tmp/rs-dev-home .venv/bin/python bench/host_scaling.py --cluster dev --private 16 --reps 3
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import _steps
from _common import (
    Report,
    Series,
    Table,
    cluster,
    driver,
    fmt_ratio,
    fmt_s,
    log,
    median,
    parse_args,
    quiet,
    wait_all_free,
)

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster

NAME = "host_scaling"
POD_TYPES = ["v6e-4", "v4-16", "v6e-16", "v6e-32", "v6e-64"]
GOAL = 1.5  # 16 hosts within 1.5x of 4 hosts


@dataclass
class Row:
    pod_type: str
    hosts: int
    rayslice: Series = field(default_factory=Series)
    rayslice_total: Series = field(default_factory=Series)
    setup: Series = field(default_factory=Series)
    hand: Series = field(default_factory=Series)
    hand_total: Series = field(default_factory=Series)


BY_HOSTS = {1: "v6e-4", 2: "v4-16", 4: "v6e-16", 8: "v6e-32", 16: "v6e-64"}
ON_DEV = [TpuSliceRequest(tpu="v6e-4"), TpuSliceRequest(tpu="v6e-16"),
          TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True)]


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], extra=_flags)
    report = Report(NAME, args)
    # (private cluster?, requests) run one after the other, each on its own cluster.
    groups: list[tuple[bool, list[TpuSliceRequest]]] = []
    if args.cluster:
        groups.append((False, [r for r in ON_DEV if r.total_hosts <= args.max_hosts]))
        sizes = [int(x) for x in args.private.split(",") if x.strip()] if args.private else []
        if sizes:
            groups.append((True, [TpuSliceRequest(tpu=BY_HOSTS[n]) for n in sizes]))
    else:
        wanted = [TpuSliceRequest(tpu=t) for t in POD_TYPES]
        wanted = [r for r in wanted if r.hosts_per_slice <= args.max_hosts]
        # Two clusters, one after the other, to stay within this machine's memory: 1, 2 and 8 hosts,
        # then 4 and 16 hosts (so the goal's two sizes share a cluster).
        groups = [(True, [r for r in wanted if r.hosts_per_slice in (1, 2, 8)]),
                  (True, [r for r in wanted if r.hosts_per_slice in (4, 16)])]
    rows: list[Row] = []
    for index, (private, group) in enumerate(g for g in groups if g[1]):
        spec = local_cluster.ClusterSpec(tpus=tuple(r.pod_type for r in group))
        with cluster(spec, f"{NAME}{index}", private=private) as record, driver(record) as ray:
            rows += _run_group(ray, group, args.reps)
        if private:
            log(f"private cluster of {sum(r.total_hosts for r in group)} TPU hosts ran and was stopped")
    rows.sort(key=lambda r: r.hosts)
    report.add(_table(rows, args))
    report.write()


def _flags(parser) -> None:
    parser.add_argument("--max-hosts", type=int, default=16, help="largest slice to run (hosts)")
    parser.add_argument(
        "--private", default="", help="with --cluster: sizes (hosts, e.g. '2,16') to run on a private cluster too"
    )


def _run_group(ray: Any, group: list[TpuSliceRequest], reps: int) -> list[Row]:
    import ray.cloudpickle

    from rayslice.cluster import run_step

    ray.cloudpickle.register_pickle_by_value(_steps)
    hand = _steps.hand_written(ray)
    trivial_task = ray.remote(_steps.trivial)
    rows = [Row(_label(r), r.total_hosts) for r in group]

    def rayslice(request: TpuSliceRequest) -> tuple[float, list[dict], float]:
        t0 = time.time()
        spec = StepSpec.for_function(
            _steps.trivial, request=request, owner=Owner(submission_id=f"bench-{time.time_ns()}")
        )
        with quiet():
            results = run_step(spec)
        return t0, results, time.time()

    def hand_written(request: TpuSliceRequest) -> tuple[float, list[dict], float]:
        t0 = time.time()
        results = _steps.flatten(ray.get(hand(trivial_task, request)))
        return t0, results, time.time()

    started = time.monotonic()
    for request in group:  # warm-up, unrecorded
        rayslice(request)
        hand_written(request)
    for rep in range(reps):
        for row, request in zip(rows, group, strict=True):
            wait_all_free(ray)
            t0, hosts, t1 = rayslice(request)
            assert len(hosts) == request.total_hosts
            row.rayslice.add(max(h["t"] for h in hosts) - t0)
            row.rayslice_total.add(t1 - t0)
            row.setup.add(max(h["t"] - h["proc_start"] for h in hosts))
            wait_all_free(ray)
            t0, hosts, t1 = hand_written(request)
            row.hand.add(max(h["t"] for h in hosts) - t0)
            row.hand_total.add(t1 - t0)
        log(f"{'+'.join(r.pod_type for r in group)}: rep {rep + 1}/{reps} ({time.monotonic() - started:.0f} s)")
    return rows


def _label(request: TpuSliceRequest) -> str:
    return request.pod_type if request.num_slices == 1 else f"{request.num_slices}× {request.pod_type} multislice"


def _table(rows: list[Row], args: Any) -> Table:
    four = next((r for r in rows if r.hosts == 4), None)
    table = Table(
        f"Dispatch time by slice size, trivial step (median / p90 over {args.reps} reps)",
        [
            "pod type",
            "hosts",
            "rayslice: all hosts running",
            "p90",
            "× 4 hosts",
            "rayslice total",
            "host process start → step",
            "(a) all hosts running",
            "p90",
            "× 4 hosts",
            "rayslice × (a)",
        ],
    )
    for row in rows:
        table.add(
            row.pod_type,
            row.hosts,
            fmt_s(row.rayslice.median()),
            fmt_s(row.rayslice.p90()),
            fmt_ratio(row.rayslice.median(), four.rayslice.median() if four else None),
            fmt_s(row.rayslice_total.median()),
            fmt_s(median(row.setup.done)) if row.setup.done else "n/a",
            fmt_s(row.hand.median()),
            fmt_s(row.hand.p90()),
            fmt_ratio(row.hand.median(), four.hand.median() if four else None),
            fmt_ratio(row.rayslice.median(), row.hand.median()),
        )
    sixteen = next((r for r in rows if r.hosts == 16), None)
    largest = max(r.hosts for r in rows)
    table.notes = [f"largest slice run: {largest} hosts ({next(r.pod_type for r in rows if r.hosts == largest)})"]
    if four and sixteen:
        ratio = sixteen.rayslice.median() / four.rayslice.median()
        table.notes.append(f"goal 16 hosts ≤ {GOAL}× 4 hosts: {ratio:.2f}× → {'met' if ratio <= GOAL else 'NOT met'}")
    table.notes.append(
        "host process start → step: per step, the slowest host's time from its fresh worker process starting "
        "to the step function running (worker start-up, JAX import and jax.distributed.initialize)"
    )
    return table


if __name__ == "__main__":
    main()
