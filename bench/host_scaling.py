"""Q3: dispatch time (submission to the step running on every host) for 1 to 16 hosts.

Pod types: v6e-4 (1 host), v4-16 (2 hosts × 4 chips), v6e-16 (4), v6e-32 (8), v6e-64 (16).
Every simulated host is a full Ray node, so the slices run on two clusters one after the other
(1+2+4+8 hosts, then 16 hosts) to stay within this machine's memory. Rows: rayslice
`run_step` with the trivial step, and the hand-written head-targeted tasks (a) for reference.

    .venv/bin/python bench/host_scaling.py [--reps 10] [--max-hosts 16]
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

from rayslice import local_cluster
from rayslice.accelerators import TpuSliceRequest
from rayslice.step import Owner, StepSpec

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


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], extra=_flags)
    report = Report(NAME, args)
    requests = [TpuSliceRequest(tpu=t) for t in POD_TYPES]
    requests = [r for r in requests if r.hosts_per_slice <= args.max_hosts]
    # Clusters of at most 16 hosts each, run one after the other.
    groups: list[list[TpuSliceRequest]] = []
    for request in requests:
        if groups and sum(r.hosts_per_slice for r in groups[-1]) + request.hosts_per_slice <= 16:
            groups[-1].append(request)
        else:
            groups.append([request])
    rows: list[Row] = []
    for index, group in enumerate(groups):
        spec = local_cluster.ClusterSpec(tpus=tuple(r.pod_type for r in group))
        with cluster(spec, f"{NAME}{index}") as record, driver(record) as ray:
            rows += _run_group(ray, group, args.reps)
    report.add(_table(rows, args))
    report.write()


def _flags(parser) -> None:
    parser.add_argument("--max-hosts", type=int, default=16, help="largest slice to run (hosts)")


def _run_group(ray: Any, group: list[TpuSliceRequest], reps: int) -> list[Row]:
    import ray.cloudpickle

    from rayslice.launcher import run_step

    ray.cloudpickle.register_pickle_by_value(_steps)
    hand = _steps.hand_written(ray)
    trivial_task = ray.remote(_steps.trivial)
    rows = [Row(r.pod_type, r.hosts_per_slice) for r in group]

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
            assert len(hosts) == request.hosts_per_slice
            row.rayslice.add(max(h["t"] for h in hosts) - t0)
            row.rayslice_total.add(t1 - t0)
            row.setup.add(max(h["t"] - h["proc_start"] for h in hosts))
            wait_all_free(ray)
            t0, hosts, t1 = hand_written(request)
            row.hand.add(max(h["t"] for h in hosts) - t0)
            row.hand_total.add(t1 - t0)
        log(f"{'+'.join(r.pod_type for r in group)}: rep {rep + 1}/{reps} ({time.monotonic() - started:.0f} s)")
    return rows


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
