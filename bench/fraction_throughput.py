"""Q4: 32 short 0.25-GPU steps through rayslice against the same 32 steps as plain Ray tasks.

A node with 3 (logical) GPUs holds 12 quarter-GPU steps at a time. Each step sleeps
`--step-s` seconds (default 0.5) and returns its start/end times and CUDA_VISIBLE_DEVICES.
The baseline, in every mode: plain Ray tasks with `num_gpus=0.25` from one driver.

- `--mode airflow` (the issue's question): one DAG run of the example DAG
  `dags/gpu_fraction_mapping.py`, 32 mapped `@task.ray_accelerator(accelerator="GPU", count=0.25,
  deferrable=True)` tasks, on a real Airflow 3 (`rayslice.local.airflow_stack.AirflowStack`,
  LocalExecutor, the trigger path); each mapped task is a Ray job. Every row runs that DAG's
  `score_shard` (a small JAX computation, JAX imported inside the step), and the baseline's
  first repetition, on freshly started workers, is reported as a row of its own. A row of the
  same 32 steps as rayslice Ray jobs submitted at once (`run_step_job`, no Airflow) is what the
  Airflow row must stay within 1.5x of; per mapped task the Airflow overhead around its step is
  reported too: task start (Airflow's `start_date`) to the step body's start, and the body's end
  to the task's `end_date`. Then a chain of four 1 s quarter-GPU steps, each given the one
  before's result (`bench/airflow_dags/chain.py`), against the same four steps as Ray jobs back
  to back, with where each chain step's seconds go (from the task instances' times and the step
  bodies' own). `--steps 24`: a 24-step sweep (the DAG's `shards` param) and 24 Ray jobs.
- `--mode driver` (default): rayslice `run_step` from 32 driver threads (one fresh host actor
  per step), without job submission: the launcher's own cost.
- `--mode jobs`: rayslice as 32 concurrent Ray jobs through the Jobs REST API (`run_step_job`).

    RAYSLICE_HOME=/tmp/rs-dev-home .venv/bin/python bench/fraction_throughput.py --cluster dev
    .venv/bin/python bench/fraction_throughput.py --mode airflow        # its own 2-node cluster

32 concurrent Ray jobs cost 32 job drivers and supervisors on this 2-core machine, so the
Airflow and jobs rows run `--job-reps` times (default 1) to keep each invocation under 10
minutes; the plain-task baseline still runs `--reps` times in the same invocation.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import ROOT, Report, Series, Table, cluster, driver, fmt_ratio, fmt_s, log, median, parse_args, quiet

from rayslice.core.accelerators import AcceleratorRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster

NAME = "fraction_throughput"
SPEC = local_cluster.ClusterSpec(gpus=3)
STEPS = 32
AIRFLOW_DAG = "rayslice_gpu_fraction_mapping"
AIRFLOW_TASK = "score"
EXAMPLE_DAG = ROOT / "dags" / "gpu_fraction_mapping.py"
CHAIN_DAG = ROOT / "bench" / "airflow_dags" / "chain.py"
CHAIN = "rayslice_bench_chain"
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
    span: Series = field(default_factory=Series)  # first step body's start to the last one's end
    errors: int = 0


def peak_concurrency(steps: list[dict]) -> int:
    events = sorted([(s["start"], 1) for s in steps] + [(s["end"], -1) for s in steps])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def main() -> None:
    global STEPS
    args = parse_args(__doc__.split("\n")[0], extra=_flags)
    STEPS = args.steps
    report = Report(NAME + ("" if args.mode == "driver" else f"_{args.mode}"), args)
    with cluster(SPEC, NAME) as record, driver(record) as ray, contextlib.ExitStack() as stack:
        from rayslice.client.submission import run_step_job
        from rayslice.cluster import run_step

        if args.mode == "airflow":  # the example DAG's own work, shipped by value like rayslice ships it
            work = _example_work()
            task = ray.remote(num_gpus=SHARE, num_cpus=0)(work)  # num_cpus=0 like rayslice's host actor
            task_args = list(range(STEPS))
        else:
            task = ray.remote(num_gpus=SHARE, num_cpus=0)(gpu_step)  # like rayslice's host actor
            task_args = [args.step_s] * STEPS

        def spec(i: int) -> StepSpec:
            if args.mode == "airflow":  # the example DAG's work, as its mapped tasks run it
                return StepSpec.for_function(work, request=REQUEST, kwargs={"shard": i},
                                             owner=Owner(submission_id=f"bench-frac-{time.time_ns()}-{i}"))
            return StepSpec.for_function(
                gpu_step,
                request=REQUEST,
                kwargs={"seconds": args.step_s},
                owner=Owner(submission_id=f"bench-frac-{time.time_ns()}-{i}"),
            )

        def plain_tasks() -> list[tuple[float, float, dict]]:
            t0 = time.time()
            refs = [task.remote(arg) for arg in task_args]
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

        def run_dag(api: Any, dag_id: str, run_id: str, conf: dict | None = None) -> float:
            """Trigger `dag_id` as `run_id` and wait (polling every 0.5 s) until it succeeds: the time it ended."""
            api.post(f"/dags/{dag_id}/dagRuns",
                     json={"dag_run_id": run_id, "logical_date": None, "conf": conf or {}}).raise_for_status()
            deadline = time.monotonic() + args.airflow_timeout
            state = None
            while state not in ("success", "failed"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"DAG run {run_id} still {state} after {args.airflow_timeout:.0f} s")
                time.sleep(0.5)
                resp = api.get(f"/dags/{dag_id}/dagRuns/{run_id}")
                state = resp.json().get("state") if resp.status_code == 200 else state
            if state != "success":
                raise RuntimeError(f"DAG run {run_id} {state}")
            return time.time()

        def returned(api: Any, task_path: str, map_index: int = -1) -> Any:
            """A task instance's return value (the REST API's XCom entry, deserialized)."""
            resp = api.get(f"{task_path}/xcomEntries/return_value",
                           params={"map_index": map_index, "deserialize": True})
            resp.raise_for_status()
            value = resp.json()["value"]
            return json.loads(value) if isinstance(value, str) else value

        def airflow_mapping() -> list[tuple[float, float, dict]]:
            api = airflow_api()
            run_id = f"bench-{time.time_ns()}"
            t0 = time.time()
            t1 = run_dag(api, AIRFLOW_DAG, run_id, {"shards": STEPS})
            out = []
            tis = api.get(f"/dags/{AIRFLOW_DAG}/dagRuns/{run_id}/taskInstances", params={"limit": 100}).json()
            times = {ti["map_index"]: ti for ti in tis["task_instances"] if ti["task_id"] == AIRFLOW_TASK}
            for i in range(STEPS):
                result = returned(api, f"/dags/{AIRFLOW_DAG}/dagRuns/{run_id}/taskInstances/{AIRFLOW_TASK}", i)
                out.append((t0, t1, result))
                ti = times[i]
                overheads["before"].append(result["start"] - _ts(ti["start_date"]))
                overheads["after"].append(_ts(ti["end_date"]) - result["end"])
                overheads["pids"].append(ti.get("pid"))
            return out

        def airflow_chain() -> list[tuple[float, float, dict]]:
            api = airflow_api()
            run_id = f"bench-chain-{time.time_ns()}"
            t0 = time.time()
            t1 = run_dag(api, CHAIN, run_id)
            out = []
            tis = api.get(f"/dags/{CHAIN}/dagRuns/{run_id}/taskInstances").json()["task_instances"]
            by_id = {ti["task_id"]: ti for ti in tis}
            previous_end = t0
            for index in range(4):
                result = returned(api, f"/dags/{CHAIN}/dagRuns/{run_id}/taskInstances/step_{index}")
                out.append((t0, t1, result))
                ti = by_id[f"step_{index}"]
                scheduled = _ts(ti.get("scheduled_when") or ti["start_date"])
                # Where a chain step's seconds go: the upstream's end (or the trigger of the run) to this task
                # scheduled, scheduled to started (deferred with its trigger), started to the body's start (the
                # trigger builds and submits, Ray starts the job), the body, the body's end to end_date (job end
                # seen, XComs pushed, the event handled).
                chain_parts["scheduler: upstream end → scheduled"].append(scheduled - previous_end)
                chain_parts["scheduled → task start"].append(_ts(ti["start_date"]) - scheduled)
                chain_parts["task start → step body start (trigger, submit, job start)"].append(
                    result["start"] - _ts(ti["start_date"]))
                chain_parts["step body"].append(result["end"] - result["start"])
                chain_parts["body end → task end (job end, XComs, event)"].append(
                    _ts(ti["end_date"]) - result["end"])
                previous_end = _ts(ti["end_date"])
            chain_parts["last task end → run seen succeeded (bench poll)"].append(t1 - previous_end)
            return out

        def jobs_chain() -> list[tuple[float, float, dict]]:
            from airflow_dags.chain import one_second

            async def chain() -> list[tuple[float, float, dict]]:
                out, previous = [], None
                for index in range(4):
                    t = time.time()
                    spec = StepSpec.for_function(one_second, request=REQUEST,
                                                 kwargs={"index": index, "previous": previous},
                                                 owner=Owner(submission_id=f"bench-chain-{time.time_ns()}-{index}"))
                    previous = await run_step_job(record.dashboard_url, spec, token=record.token,
                                                  emit=lambda _: None)
                    out.append((t, time.time(), previous))
                return out

            return asyncio.run(chain())

        def airflow_api() -> Any:
            if not hasattr(airflow_api, "client"):
                import httpx
                from airflow_concurrency import BenchStack, stop_jobs

                log("starting Airflow")
                stack.callback(stop_jobs, record, AIRFLOW_DAG)  # runs after the stack stopped, also on error
                dags = Path(tempfile.mkdtemp(prefix="rs-bench-frac-dags-"))
                stack.callback(shutil.rmtree, dags, True)
                shutil.copy(EXAMPLE_DAG, dags / EXAMPLE_DAG.name)  # the example DAG, as users run it
                shutil.copy(CHAIN_DAG, dags / CHAIN_DAG.name)
                af = stack.enter_context(BenchStack(record.dashboard_url, record.token, dags_folder=dags, steps=STEPS,
                                                    parallelism=args.parallelism))
                api = stack.enter_context(httpx.Client(base_url=f"{af.url}/api/v2", timeout=60,
                                                       headers={"Authorization": f"Bearer {af.api_token()}"}))
                deadline = time.monotonic() + 180
                while any(api.get(f"/dags/{d}").status_code != 200 for d in (AIRFLOW_DAG, CHAIN)):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the DAG processor did not register {AIRFLOW_DAG}")
                    time.sleep(1)
                log(f"Airflow up at {af.url}")
                airflow_api.client = api
            return airflow_api.client

        rows = []
        overheads: dict[str, list] = {"before": [], "after": [], "pids": []}
        chain_parts: dict[str, list[float]] = collections.defaultdict(list)
        if args.mode == "airflow":
            airflow_api()  # started before the clock runs; it stays up (and busy) during every row
            baseline = Row("plain Ray tasks, num_gpus=0.25, num_cpus=0")
            cold = Row("plain Ray tasks, first run (fresh worker processes)")
            if not args.chain_only:
                log(f"first run: {cold.label}")
                _measure(ray, cold, plain_tasks)
            rows.append((baseline, plain_tasks, 0 if args.chain_only else args.reps))
            rows.append((Row(f"Airflow: {STEPS} mapped deferrable @task.ray_accelerator tasks (one DAG run)"),
                         airflow_mapping, 0 if args.chain_only else args.job_reps))
            rows.append((Row(f"rayslice as {STEPS} Ray jobs submitted at once (run_step_job, no Airflow)"),
                         rayslice_jobs, 0 if args.chain_only else args.job_reps))
            rows.append((Row("Airflow: a chain of four 1 s steps (one DAG run)"), airflow_chain, args.job_reps))
            rows.append((Row("rayslice: the same four steps as Ray jobs back to back"), jobs_chain, args.job_reps))
        elif args.mode == "driver":
            rows += [
                (Row("plain Ray tasks, num_gpus=0.25, num_cpus=0"), plain_tasks, args.reps),
                (Row("rayslice run_step, 32 driver threads"), rayslice_threads, args.reps),
            ]
            for row, fn, _ in rows:  # warm-up, unrecorded
                log(f"warm-up: {row.label}")
                _measure(ray, Row("warm-up"), fn)
        else:
            baseline = Row("plain Ray tasks, num_gpus=0.25, num_cpus=0")
            rows.append((baseline, plain_tasks, args.reps))
            log(f"warm-up: {baseline.label}")
            _measure(ray, Row("warm-up"), plain_tasks)
            rows.append((Row("rayslice as 32 concurrent Ray jobs (run_step_job)"), rayslice_jobs, args.job_reps))
        started = time.monotonic()
        for rep in range(max(reps for _, _, reps in rows)):
            for row, fn, reps in rows:
                if rep < reps:
                    _measure(ray, row, fn)
            log(f"rep {rep + 1} done ({time.monotonic() - started:.0f} s)")
        if not args.chain_only:
            report.add(_table([r for r, _, _ in rows] + ([cold] if args.mode == "airflow" else []), args))
        if args.mode == "airflow" and chain_parts:
            airflow_row, jobs_row = rows[1][0], rows[2][0]
            before, after, pids = overheads["before"], overheads["after"], overheads["pids"]
            ratio = fmt_ratio(airflow_row.makespan.median(), jobs_row.makespan.median())
            chain = fmt_ratio(rows[3][0].makespan.median(), rows[4][0].makespan.median())
            report.note(
                f"- mapped: Airflow makespan / Ray jobs makespan: {ratio}\n"
                f"- chain of four: Airflow makespan / Ray jobs back to back: {chain}\n"
                + (f"- per mapped task, Airflow's start_date → step body start: median {fmt_s(median(before))}"
                   f" (p90 {fmt_s(_p90(before))}); step body end → end_date: median {fmt_s(median(after))}"
                   f" (p90 {fmt_s(_p90(after))}), n={len(after)}\n"
                   f"- mapped tasks that ran an Airflow task process (a pid): "
                   f"{sum(p is not None for p in pids)} of {len(pids)}\n" if before else "")
                + f"- load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}\n"
                "- where a chain step's seconds go (median per step, all steps of every rep):\n"
                + "\n".join(f"  - {part}: {fmt_s(median(values))}" for part, values in chain_parts.items()))
    report.write()


def _ts(value: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _example_work() -> Any:
    """`score_shard` of the example DAG, pickled by value (the workers cannot import the DAG file)."""
    import importlib.util

    from ray import cloudpickle

    spec = importlib.util.spec_from_file_location("rayslice_example_gpu_fraction_mapping", EXAMPLE_DAG)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module.score_shard


def _flags(parser) -> None:
    parser.add_argument("--chain-only", action="store_true", help="airflow mode: only the chain rows")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"steps in the mapped sweep (default {STEPS})")
    parser.add_argument("--step-s", type=float, default=0.5, help="how long each step runs (s)")
    parser.add_argument("--mode", choices=["driver", "jobs", "airflow"], default="driver",
                        help="which rayslice row to measure against plain tasks (see the module doc)")
    parser.add_argument("--job-reps", type=int, default=1, help="repetitions of the jobs / Airflow row (default 1)")
    parser.add_argument("--parallelism", type=int, default=4, help="Airflow LocalExecutor worker slots (default 4)")
    parser.add_argument("--airflow-timeout", type=float, default=600, help="longest wait for the DAG run (s)")


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
    row.span.add(max(r["end"] for _, _, r in out) - min(r["start"] for _, _, r in out))


def _table(rows: list[Row], args: Any) -> Table:
    base = rows[0]
    ideal = math.ceil(STEPS / (3 / SHARE)) * args.step_s
    work = "the example DAG's score_shard (JAX)" if args.mode == "airflow" else f"{args.step_s:g} s"
    table = Table(
        f"{STEPS} steps of {SHARE:g} GPU × {work} on one 3-GPU node (median / p90 over the reps)",
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
            "step bodies: first start → last end",
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
            fmt_s(row.span.median()),
        )
    table.notes = [
        f"ideal makespan with 12 slots: {math.ceil(STEPS / (3 / SHARE))} waves × {args.step_s:g} s = {fmt_s(ideal)}"
        if args.mode != "airflow" else "every row runs the same function (imports JAX, a 64×64 matmul) with the "
        "same argument per step; plain tasks reuse Ray's worker processes between repetitions (JAX already "
        "imported), rayslice starts a fresh process per step",
        "per-step latency: from the step's submission to its result in the caller; makespan: first submission "
        "to last result (Airflow: from triggering the DAG run to seeing it succeed, polled every 1 s; its "
        "per-step latency column is that same wall time)",
        "peak concurrent: most steps whose function bodies overlapped in time (12 = every quarter-GPU slot used)",
    ]
    return table


def _p90(values: list[float]) -> float | None:
    from _common import percentile

    return percentile(values, 90) if values else None


if __name__ == "__main__":
    main()
