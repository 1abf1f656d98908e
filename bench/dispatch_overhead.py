"""Q1: from submission to the step running on all hosts, and total wall time, for a trivial step.

`--mode jobs` (the default; the issue's comparison): on one warm simulated cluster (a v6e-4 and
two v6e-16), every method is submitted as a Ray job through the Jobs REST API and followed the
same way: rayslice (`run_step_job`); (a) the hand-written head-targeted pattern and (b) the
one-shot `ray.util.tpu.run_on_slice`, both from `bench/_job_baseline.py`; and the same rayslice
step through Airflow (`dag.test()` of a TpuSliceOperator DAG), to show what Airflow adds.

`--mode driver`: the launcher's own cost without job submission, each measured from one
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

    RAYSLICE_HOME=/tmp/rs-dev-home .venv/bin/python bench/dispatch_overhead.py --cluster dev [--reps 10]
    RAYSLICE_HOME=/tmp/rs-dev-home .venv/bin/python bench/dispatch_overhead.py --cluster dev --mode driver
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shlex
import socket
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
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

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster

NAME = "dispatch_overhead"
SPEC = local_cluster.ClusterSpec(tpus=("v6e-4", "v6e-16", "v6e-16"))
SHAPES = {
    "v6e-4": ("v6e-4 (1 host)", TpuSliceRequest(tpu="v6e-4")),
    "v6e-16": ("v6e-16 (4 hosts)", TpuSliceRequest(tpu="v6e-16")),
    "2xv6e-16": ("2× v6e-16 multislice (8 hosts)", TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True)),
}


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


def zip_file(path: Path) -> bytes:
    """One file as a working_dir package (fixed timestamp, so the same bytes upload once)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(zipfile.ZipInfo(path.name, date_time=(1980, 1, 1, 0, 0, 0)), path.read_text())
    return buf.getvalue()


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
    shapes = args.shape or list(SHAPES)
    suffix = ("" if args.mode == "jobs" else "_driver") + ("" if len(shapes) == len(SHAPES) else "_" + "_".join(shapes))
    report = Report(NAME + suffix, args)
    with cluster(SPEC, NAME) as record, driver(record) as ray:
        import ray.cloudpickle

        ray.cloudpickle.register_pickle_by_value(_steps)
        rows = _job_rows(record, args) if args.mode == "jobs" else _driver_rows(ray, record, args)
        warm_up_workers(ray)
        started = time.monotonic()
        results: dict[str, list[Row]] = {}
        for label, request in (SHAPES[s] for s in shapes):
            shape_rows = [Row(r.label, r.run, r.optional) for r in rows]
            results[label] = shape_rows
            log(f"{label}: warm-up")
            for row in shape_rows:  # one unrecorded run of the cheap rows: workers started on every host
                if not row.optional:
                    _measure(ray, row, request, record=False)
            for rep in range(args.reps):
                for row in shape_rows:  # interleaved, so load changes hit every method alike
                    if not row.optional or rep < args.extra_reps:
                        _measure(ray, row, request)
                log(f"{label}: rep {rep + 1}/{args.reps} done ({time.monotonic() - started:.0f} s)")
        report.add(_table(results, args))
        report.add(_diagnostics(results))
    report.write()


def _job_rows(record: Any, args: Any) -> list[Row]:
    """Every method submitted as a Ray job through the Jobs REST API, followed by polling every 1 s."""
    from rayslice.client.jobs_client import AsyncRayJobsClient
    from rayslice.client.submission import run_step_job

    package = zip_file(Path(__file__).with_name("_job_baseline.py"))

    def rayslice_job(request: TpuSliceRequest) -> tuple[float, list[dict], float]:
        t0 = time.time()
        spec = StepSpec.for_function(
            _steps.trivial, request=request, owner=Owner(submission_id=f"bench-job-{time.time_ns()}")
        )
        results = asyncio.run(run_step_job(record.dashboard_url, spec, token=record.token, emit=lambda _: None))
        return t0, results, time.time()

    async def baseline_job(method: str, request: TpuSliceRequest) -> list[dict]:
        shape = {
            "head_resource": request.head_resource,
            "hosts": request.hosts_per_slice,
            "chips": request.chips_per_host,
            "num_slices": request.num_slices,
            "topology": request.topology,
            "version": request.version,
            "pod_type": request.pod_type,
        }
        async with AsyncRayJobsClient(record.dashboard_url, token=record.token) as client:
            uri = await client.ensure_package(package)
            sid = await client.submit(
                f"python _job_baseline.py {method} {shlex.quote(json.dumps(shape))}",
                submission_id=f"bench-{method}-{time.time_ns()}",
                runtime_env={"working_dir": uri, "env_vars": {"RAY_DEDUP_LOGS": "0"}},
            )
            while not (job := await client.get(sid)).is_terminal:  # as rayslice's wait_for_step: every 1 s
                await asyncio.sleep(1.0)
            text = await client.logs(sid)
        lines = [line for line in text.splitlines() if line.startswith("::bench-result::")]
        if job.status.value != "SUCCEEDED" or not lines:
            raise RuntimeError(f"job {sid} {job.status.value}: {text[-500:]}")
        return json.loads(lines[-1].removeprefix("::bench-result::"))

    def baseline(method: str) -> Callable:
        def run(request: TpuSliceRequest) -> tuple[float, list[dict], float]:
            t0 = time.time()
            results = asyncio.run(baseline_job(method, request))
            return t0, results, time.time()

        return run

    rows = [
        Row("rayslice as a Ray job (run_step_job)", rayslice_job),
        Row("(a) hand-written head-targeted pattern, as a Ray job", baseline("a")),
        Row("(b) run_on_slice (one-shot), as a Ray job", baseline("b")),
    ]
    if not args.no_airflow:
        rows.append(Row("rayslice through Airflow (dag.test(), not deferrable)", _airflow_dag_test(record)))
    return rows


def _airflow_dag_test(record: Any) -> Callable:
    """A private Airflow (SQLite) with one DAG per shape; each run is a `dag.test()` in this process."""
    home = Path(tempfile.mkdtemp(prefix="rs-bench-airflow-"))
    (home / "dags").mkdir()
    os.environ.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
        "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps([{
            "name": "dags-folder", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
            "kwargs": {"path": str(home / "dags")}}]),
        "AIRFLOW_CONN_RAY_DEFAULT": json.dumps(
            {"conn_type": "ray", "host": record.dashboard_url} | ({"password": record.token} if record.token else {})
        ),
    })
    path = home / "dags" / "bench_dispatch.py"
    path.write_text(AIRFLOW_DAGS)
    from airflow.dag_processing.dagbag import DagBag
    from airflow.utils import db

    log("Airflow: migrating a fresh SQLite DB")
    db.initdb()
    dags = DagBag(dag_folder=str(path), safe_mode=False).dags

    def run(request: TpuSliceRequest) -> tuple[float, list[dict], float]:
        from airflow.models.xcom import XComModel
        from airflow.utils.session import create_session

        dag = dags[f"bench_dispatch_{request.pod_type.replace('-', '_')}_x{request.num_slices}"]
        t0 = time.time()
        with quiet():
            dag_run = dag.test()
        t1 = time.time()
        with create_session() as session:
            rows = session.scalars(
                XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag_run.dag_id, task_ids="step", key="return_value")
            ).all()
            values = [XComModel.deserialize_value(r) for r in rows]
        if not values:
            raise RuntimeError(f"dag.test() of {dag.dag_id} left no result (state {dag_run.state})")
        return t0, values[0], t1

    return run


AIRFLOW_DAGS = """
from datetime import datetime

from airflow.sdk import DAG
from rayslice.operators.tpu_slice import TpuSliceOperator


def trivial():
    import os, sys, time

    now = time.time()
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return {"t": now, "pid": os.getpid(), "jax_loaded": "jax" in sys.modules,
            "proc_start": btime + ticks / os.sysconf("SC_CLK_TCK")}


for tpu, slices in (("v6e-4", 1), ("v6e-16", 1), ("v6e-16", 2)):
    dag_id = f"bench_dispatch_{tpu.replace('-', '_')}_x{slices}"
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1), catchup=False) as dag:
        TpuSliceOperator(task_id="step", tpu=tpu, num_slices=slices, multislice=slices > 1, python_callable=trivial,
                         deferrable=False, poll_interval=1, retries=0)
    globals()[dag_id] = dag
"""


def _driver_rows(ray: Any, record: Any, args: Any) -> list[Row]:
    """Every method from this one long-lived driver (no job submission): the launcher's own cost."""
    from rayslice.client.submission import run_step_job
    from rayslice.cluster import run_step

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
    return rows


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
    parser.add_argument(
        "--mode",
        choices=["jobs", "driver"],
        default="jobs",
        help="jobs (default): every method submitted as a Ray job, plus Airflow's dag.test(); "
        "driver: every method from one long-lived driver (writes dispatch_overhead_driver.md)",
    )
    parser.add_argument("--no-airflow", action="store_true", help="jobs mode: skip the Airflow dag.test() row")
    parser.add_argument(
        "--shape",
        action="append",
        choices=list(SHAPES),
        help="measure only this shape (repeatable; default all three, which takes longer than 10 minutes "
        "on 2 cores: run one shape per command)",
    )
    parser.add_argument("--no-jobs", action="store_true", help="driver mode: skip the 'as a Ray job' row")
    parser.add_argument(
        "--extra-reps",
        type=int,
        default=3,
        help="repetitions of the two extra rows, (a) + JAX and rayslice as a Ray job (default 3: time budget)",
    )


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


def _table(results: dict[str, list[Row]], args: Any) -> Table:
    table = Table(
        "Dispatch overhead, trivial step (median / p90 over n reps; ratios of medians)",
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
    ]
    if args.mode == "jobs":
        table.notes += [
            "every method is a Ray job submitted through the Jobs REST API from this process and followed by "
            "polling its status every 1 s (rayslice's own wait_for_step does the same): total wall includes the "
            "job driver's start-up and exit and up to 1 s of polling",
            "(a) and (b) run from `bench/_job_baseline.py` (a one-file working_dir); (b) is the one-shot "
            "run_on_slice, whose placement group goes when the job's driver exits",
            "Airflow: `dag.test()` of a one-task DAG (TpuSliceOperator, not deferrable, poll_interval=1) in this "
            "process, on a private SQLite Airflow; it submits the same Ray job as run_step_job",
        ]
    else:
        table.notes.append(
            "(b) is measured with a slice handle + shutdown() in the same long-lived driver (the one-shot form "
            "never releases in a long-lived driver)"
        )
    return table


def _diagnostics(results: dict[str, list[Row]]) -> Table:
    table = Table(
        "Where the time goes (medians)",
        [
            "method",
            "host processes started after submission",
            "JAX imported before the step",
            "host process start → step start",
        ],
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
                fmt_s(median([v for v, f in zip(row.setup.values, row.fresh, strict=True) if f and v is not None]))
                if any(row.fresh)
                else "(process started before submission)",
            )
    table.notes = [
        "started after submission: every host's worker process was started for this step; otherwise Ray "
        "handed the task (or rayslice's new actor) a worker process it had started earlier (its idle pool)",
        "host process start → step start: median over the runs whose processes were all started after "
        "submission: Python/Ray worker start-up plus what runs before the step (rayslice: import JAX, "
        "jax.distributed.initialize on multi-host slices)",
    ]
    return table


if __name__ == "__main__":
    main()
