"""Q1: from submission to the step running on all hosts, and total wall time, for a trivial step.

Compares, on one warm simulated cluster (a v6e-4 and two v6e-16), each measured from one
long-lived driver (`ray.init(address=gcs)`):

- rayslice `run_step` (fresh host actors per step, JAX wired by the launcher);
- (a) the hand-written head-targeted pattern from Ray's TPU docs (`run_on_pod` on
  `TPU-<type>-head`, one task per host with `{<slice name>: 1, "TPU": 4}`);
- (b) `ray.util.tpu.run_on_slice` with a slice handle + `shutdown()` (the one-shot form keeps its
  placement group until the driver exits, see release_latency.py);

plus rayslice with a JAX step (`jax.device_count()`), rayslice as a Ray job (`run_step_job`,
through the Jobs REST API), and (a) with JAX initialized by hand in a fresh process per host.

"All hosts running" = max over hosts of the time.time() at which the step function starts,
minus the time of submission. Total = until the call returns the hosts' results.

    .venv/bin/python bench/dispatch_overhead.py [--reps 10]
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
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
    warm_up_workers,
)

from rayslice import local_cluster
from rayslice.accelerators import TpuSliceRequest
from rayslice.step import Owner, StepSpec

NAME = "dispatch_overhead"
SPEC = local_cluster.ClusterSpec(tpus=("v6e-4", "v6e-16", "v6e-16"))
SHAPES = [
    ("v6e-4 (1 host)", TpuSliceRequest(tpu="v6e-4")),
    ("v6e-16 (4 hosts)", TpuSliceRequest(tpu="v6e-16")),
    ("2× v6e-16 multislice (8 hosts)", TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True)),
]


@dataclass
class Row:
    label: str
    run: Callable[[TpuSliceRequest], tuple[float, list[dict], float]]  # -> (submit, host results, returned)
    optional: bool = False
    running: Series = field(default_factory=Series)
    total: Series = field(default_factory=Series)
    setup: Series = field(default_factory=Series)  # host process start -> step start (max over hosts)
    fresh: list[bool] = field(default_factory=list)  # every host process started after submission
    jax_before: list[bool] = field(default_factory=list)  # JAX already imported when the step began
    errors: list[str] = field(default_factory=list)


def hand_jax_step(coordinator: str, num_processes: int, slice_index: int, hosts: int, chips: int) -> dict:
    """(a) with JAX: what a hand-written gang does itself on a simulated slice (cf. SimulatedTpuSlice)."""
    import os
    import sys
    import time

    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={chips}"
    jax_before = "jax" in sys.modules
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if num_processes > 1:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=slice_index * hosts + int(os.environ["TPU_WORKER_ID"]),
            local_device_ids=list(range(chips)),
            cluster_detection_method="deactivate",
            initialization_timeout=120,
        )
    devices = jax.device_count()
    now = time.time()
    if num_processes > 1:
        jax.distributed.shutdown()
    return {"t": now, "devices": devices, "jax_loaded": jax_before, "proc_start": _steps._proc_start()}


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], extra=_flags)
    report = Report(NAME, args)
    with cluster(SPEC, NAME) as record, driver(record) as ray:
        import ray.cloudpickle

        from rayslice.launcher import run_step
        from rayslice.submission import run_step_job

        ray.cloudpickle.register_pickle_by_value(_steps)
        hand = _steps.hand_written(ray)
        trivial_task = ray.remote(_steps.trivial)
        hand_jax_task = ray.remote(max_calls=1)(hand_jax_step)

        def rayslice(fn: Callable) -> Callable:
            def run(request: TpuSliceRequest) -> tuple[float, list[dict], float]:
                t0 = time.time()
                spec = StepSpec.for_function(fn, request=request, owner=Owner(submission_id=f"bench-{time.time_ns()}"))
                with quiet():
                    results = run_step(spec)
                return t0, results, time.time()

            return run

        def rayslice_job(request: TpuSliceRequest) -> tuple[float, list[dict], float]:
            t0 = time.time()
            spec = StepSpec.for_function(
                _steps.trivial, request=request, owner=Owner(submission_id=f"bench-job-{time.time_ns()}")
            )
            results = asyncio.run(run_step_job(record.dashboard_url, spec, token=record.token, emit=lambda _: None))
            return t0, results, time.time()

        def hand_written(request: TpuSliceRequest) -> tuple[float, list[dict], float]:
            t0 = time.time()
            results = _steps.flatten(ray.get(hand(trivial_task, request)))
            return t0, results, time.time()

        def hand_written_jax(request: TpuSliceRequest) -> tuple[float, list[dict], float]:
            t0 = time.time()
            with socket.socket() as sock:  # simulation only: every host is this machine
                sock.bind(("127.0.0.2", 0))
                port = sock.getsockname()[1]
            processes = request.total_hosts if request.multislice else request.hosts_per_slice
            refs = [
                _run_on_pod_jax(ray, hand_jax_task, request, f"127.0.0.2:{port}", processes, i)
                for i in range(request.num_slices)
            ]
            results = _steps.flatten(ray.get(refs))
            return t0, results, time.time()

        def run_on_slice(request: TpuSliceRequest) -> tuple[float, list[dict], float]:
            t0 = time.time()
            results = _steps.run_on_slice_with_handle(ray, trivial_task, request)
            return t0, results, time.time()

        rows = [
            Row("rayslice run_step", rayslice(_steps.trivial)),
            Row("(a) hand-written head-targeted tasks", hand_written),
            Row("(b) run_on_slice, handle + shutdown()", run_on_slice),
            Row("rayslice run_step, JAX step (device_count)", rayslice(_steps.jax_devices)),
            Row("(a) + JAX init by hand, fresh process per host", hand_written_jax, optional=True),
        ]
        if not args.no_jobs:
            rows.append(Row("rayslice as a Ray job (run_step_job)", rayslice_job, optional=True))

        warm_up_workers(ray)
        started = time.monotonic()
        results: dict[str, list[Row]] = {}
        for label, request in SHAPES:
            shape_rows = [Row(r.label, r.run, r.optional) for r in rows]
            results[label] = shape_rows
            log(f"{label}: warm-up")
            for row in shape_rows:  # one unrecorded run each: the cluster is warm for every method
                _measure(ray, row, request, record=False)
            for rep in range(args.reps):
                for row in shape_rows:  # interleaved, so load changes hit every method alike
                    _measure(ray, row, request)
                log(f"{label}: rep {rep + 1}/{args.reps} done ({time.monotonic() - started:.0f} s)")
        report.add(_table(results, args.reps))
        report.add(_diagnostics(results))
    report.write()


def _run_on_pod_jax(ray: Any, task: Any, request: TpuSliceRequest, coordinator: str, processes: int, index: int):
    @ray.remote
    def run_on_pod(fn: Any) -> list[Any]:
        import ray as _ray

        name = _ray.util.tpu.get_current_pod_name()
        return _ray.get(
            [
                fn.options(resources={name: 1, "TPU": request.chips_per_host}).remote(
                    coordinator, processes, index, request.hosts_per_slice, request.chips_per_host
                )
                for _ in range(request.hosts_per_slice)
            ]
        )

    return run_on_pod.options(resources={request.head_resource: 1}).remote(task)


def _flags(parser) -> None:
    parser.add_argument("--no-jobs", action="store_true", help="skip the 'as a Ray job' row (slowest)")


def _measure(ray: Any, row: Row, request: TpuSliceRequest, record: bool = True) -> None:
    if not wait_all_free(ray):
        log("warning: TPU chips not all free before a measurement")
    try:
        t0, hosts, t1 = row.run(request)
    except Exception as exc:  # noqa: BLE001 - a failed run is reported, not fatal
        log(f"{row.label}: {type(exc).__name__}: {str(exc)[:300]}")
        if record:
            row.errors.append(type(exc).__name__)
            row.running.add(None)
            row.total.add(None)
        return
    if len(hosts) != request.total_hosts:
        raise RuntimeError(f"{row.label}: {len(hosts)} host results for {request}")
    if not record:
        return
    row.running.add(max(h["t"] for h in hosts) - t0)
    row.total.add(t1 - t0)
    row.setup.add(max(h["t"] - h["proc_start"] for h in hosts))
    row.fresh.append(all(h["proc_start"] > t0 - 0.05 for h in hosts))
    row.jax_before.append(any(h["jax_loaded"] for h in hosts))


def _table(results: dict[str, list[Row]], reps: int) -> Table:
    table = Table(
        f"Dispatch overhead, trivial step (median / p90 over {reps} reps; ratios of medians)",
        [
            "method",
            "n",
            "all hosts running",
            "p90",
            "× (a)",
            "× (b)",
            "total wall",
            "p90",
            "× (a)",
            "× (b)",
        ],
    )
    for label, rows in results.items():
        table.section(label)
        a, b = rows[1], rows[2]
        for row in rows:
            table.add(
                row.label + (f" ({len(row.errors)} failed)" if row.errors else ""),
                row.running.n,
                fmt_s(row.running.median()),
                fmt_s(row.running.p90()),
                fmt_ratio(row.running.median(), a.running.median()),
                fmt_ratio(row.running.median(), b.running.median()),
                fmt_s(row.total.median()),
                fmt_s(row.total.p90()),
                fmt_ratio(row.total.median(), a.total.median()),
                fmt_ratio(row.total.median(), b.total.median()),
            )
    table.notes = [
        "all hosts running: max over hosts of the step function's start time.time() minus submission time "
        "(JAX rows: the time jax.device_count() returned on the last host)",
        "total wall: submission until the call returned every host's result; for rayslice this includes "
        "killing the host actors and waiting until Ray marks its placement groups REMOVED",
        "(b) is measured with a slice handle + shutdown() in the same long-lived driver (the one-shot form "
        "never releases in a long-lived driver)",
    ]
    return table


def _diagnostics(results: dict[str, list[Row]]) -> Table:
    table = Table(
        "Where the time goes (medians)",
        ["method", "host processes fresh", "JAX imported before the step", "host process start → step start"],
    )
    for label, rows in results.items():
        table.section(label)
        for row in rows:
            if not row.fresh:
                continue
            table.add(
                row.label,
                f"{sum(row.fresh)}/{len(row.fresh)}",
                f"{sum(row.jax_before)}/{len(row.jax_before)}",
                fmt_s(median(row.setup.done)) if row.fresh and any(row.fresh) else "(reused worker)",
            )
    table.notes = [
        "fresh: every host's worker process was started after submission (a new process for this step)",
        "host process start → step start: for fresh processes, Python/Ray worker start-up plus whatever the "
        "launcher does before calling the step (rayslice: import JAX, jax.distributed.initialize)",
    ]
    return table


if __name__ == "__main__":
    main()
