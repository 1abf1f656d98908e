"""Q4: 32 short 0.25-GPU steps through rayslice against the same 32 steps as plain Ray tasks.

A node with 3 (logical) GPUs holds 12 quarter-GPU steps at a time. Each step sleeps
`--step-s` seconds (default 0.5) and returns its start/end times and CUDA_VISIBLE_DEVICES.

Rows: plain Ray tasks with `num_gpus=0.25` (the baseline); rayslice `run_step` from 32 driver
threads (one fresh host actor per step); rayslice as 32 concurrent Ray jobs through the Jobs
REST API (`run_step_job`, what the Airflow operator does). An Airflow dynamic-task-mapping row
is left for a teammate (marked below).

    .venv/bin/python bench/fraction_throughput.py [--reps 10] [--job-reps 3]
"""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from _common import ROOT, Report, Series, Table, cluster, driver, fmt_ratio, fmt_s, log, median, parse_args, quiet

from rayslice import local_cluster
from rayslice.accelerators import AcceleratorRequest
from rayslice.step import Owner, StepSpec

NAME = "fraction_throughput"
SPEC = local_cluster.ClusterSpec(gpus=3)
STEPS = 32
SHARE = 0.25
REQUEST = AcceleratorRequest(resource="GPU", count=SHARE)

assert ROOT


def gpu_step(seconds: float) -> dict[str, Any]:
    import os
    import time

    start = time.time()
    time.sleep(seconds)
    return {"start": start, "end": time.time(), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")}


@dataclass
class Row:
    label: str
    makespan: Series = field(default_factory=Series)
    latency: list[float] = field(default_factory=list)  # per step, pooled over repetitions
    peak: list[int] = field(default_factory=list)
    errors: int = 0


def peak_concurrency(steps: list[dict]) -> int:
    events = sorted([(s["start"], 1) for s in steps] + [(s["end"], -1) for s in steps])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], extra=_flags)
    report = Report(NAME, args)
    with cluster(SPEC, NAME) as record, driver(record) as ray:
        from rayslice.launcher import run_step
        from rayslice.submission import run_step_job

        task = ray.remote(num_gpus=SHARE, num_cpus=0)(gpu_step)  # like rayslice's host actor

        def spec(i: int) -> StepSpec:
            return StepSpec.for_function(
                gpu_step,
                request=REQUEST,
                kwargs={"seconds": args.step_s},
                owner=Owner(submission_id=f"bench-frac-{time.time_ns()}-{i}"),
            )

        def plain_tasks() -> list[tuple[float, float, dict]]:
            t0 = time.time()
            refs = [task.remote(args.step_s) for _ in range(STEPS)]
            out = []
            pending = list(refs)
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                out.append((t0, time.time(), ray.get(ready[0])))
            return out

        def rayslice_threads() -> list[tuple[float, float, dict]]:
            def one(i: int) -> tuple[float, float, dict]:
                t = time.time()
                result = run_step(spec(i))
                return t, time.time(), result

            with quiet(), ThreadPoolExecutor(max_workers=STEPS) as pool:
                return list(pool.map(one, range(STEPS)))

        def rayslice_jobs() -> list[tuple[float, float, dict]]:
            async def one(i: int) -> tuple[float, float, dict]:
                t = time.time()
                result = await run_step_job(record.dashboard_url, spec(i), token=record.token, emit=lambda _: None)
                return t, time.time(), result

            async def all_of_them():
                return await asyncio.gather(*(one(i) for i in range(STEPS)))

            return asyncio.run(all_of_them())

        rows = [
            (Row("plain Ray tasks, num_gpus=0.25, num_cpus=0"), plain_tasks, args.reps),
            (Row("rayslice run_step, 32 driver threads"), rayslice_threads, args.reps),
        ]
        if args.job_reps:
            rows.append((Row("rayslice as 32 concurrent Ray jobs (run_step_job)"), rayslice_jobs, args.job_reps))

        for row, fn, _ in rows:  # warm-up, unrecorded
            log(f"warm-up: {row.label}")
            _measure(ray, Row("warm-up"), fn)
        started = time.monotonic()
        for rep in range(args.reps):
            for row, fn, reps in rows:
                if rep < reps:
                    _measure(ray, row, fn)
            log(f"rep {rep + 1}/{args.reps} done ({time.monotonic() - started:.0f} s)")
        report.add(_table([r for r, _, _ in rows], args))
    report.write()


def _flags(parser) -> None:
    parser.add_argument("--step-s", type=float, default=0.5, help="how long each step runs (s)")
    parser.add_argument("--job-reps", type=int, default=10, help="repetitions of the Ray-jobs row (0 to skip)")


def _measure(ray: Any, row: Row, fn: Any) -> None:
    deadline = time.monotonic() + 30
    while ray.available_resources().get("GPU", 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.time()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001
        log(f"{row.label}: {type(exc).__name__}: {str(exc)[:300]}")
        row.errors += 1
        row.makespan.add(None)
        return
    row.makespan.add(max(end for _, end, _ in out) - t0)
    row.latency += [end - start for start, end, _ in out]
    row.peak.append(peak_concurrency([result for _, _, result in out]))


def _table(rows: list[Row], args: Any) -> Table:
    base = rows[0]
    ideal = math.ceil(STEPS / (3 / SHARE)) * args.step_s
    table = Table(
        f"{STEPS} steps of {SHARE:g} GPU × {args.step_s:g} s on one 3-GPU node (median / p90 over the reps)",
        [
            "method",
            "n",
            "makespan",
            "p90",
            "× plain tasks",
            "steps/s",
            "per-step latency (median)",
            "p90",
            "peak concurrent",
        ],
    )
    for row in rows:
        m = row.makespan.median()
        table.add(
            row.label + (f" ({row.errors} failed)" if row.errors else ""),
            row.makespan.n,
            fmt_s(m),
            fmt_s(row.makespan.p90()),
            fmt_ratio(m, base.makespan.median()),
            f"{STEPS / m:.1f}" if m else "n/a",
            fmt_s(median(row.latency)) if row.latency else "n/a",
            fmt_s(_p90(row.latency)),
            f"{min(row.peak)}–{max(row.peak)}" if row.peak else "n/a",
        )
    # Placeholder for the teammate's Airflow dynamic-task-mapping row (Airflow → rayslice jobs).
    table.add("AIRFLOW DYNAMIC TASK MAPPING: pending (teammate)", "", "", "", "", "", "", "", "")
    table.notes = [
        f"ideal makespan with 12 slots: {math.ceil(STEPS / (3 / SHARE))} waves × {args.step_s:g} s = {fmt_s(ideal)}",
        "per-step latency: from the step's submission to its result in the caller; makespan: first submission "
        "to last result",
        "peak concurrent: most steps whose function bodies overlapped in time (12 = every quarter-GPU slot used)",
    ]
    return table


def _p90(values: list[float]) -> float | None:
    from _common import percentile

    return percentile(values, 90) if values else None


if __name__ == "__main__":
    main()
