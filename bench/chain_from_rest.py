"""Issue 52: a chain of four 1 s quarter-GPU steps as a user times it, next to the same four Ray jobs back to back.

What a user does: `rayslice airflow up --dags <folder>` (the demo cluster: two v6e-16, a v6e-4, a
3-GPU node), then triggers `bench/airflow_dags/chain.py` (four `@task.ray_accelerator(accelerator=
"GPU", count=0.25)` steps, each given the one before's result; default start: in the triggerer)
through the REST API (`POST /api/v2/dags/{id}/dagRuns`) and polls the run every 0.5 s until the
REST API reports it `success`. That wall time is the figure the user sees. Next to it, in the same
run and on the same cluster, the same four steps as rayslice Ray jobs submitted back to back from
this process (`run_step_job`). One unrecorded warm-up of each first, then `--reps` (default 3)
alternating repetitions; the medians are compared.

Every second of the chain is split, per step, from Airflow's task-instance times (REST), the DAG
run's times, the Ray job's record (dashboard `GET /api/jobs/{id}`), the step body's own start and
end (its result), and the trigger's log lines (the task's trigger log file in the AIRFLOW_HOME):

- first step: DAG run created (the POST) → the run `running` → the task `scheduled`;
  later steps: the upstream task's success → this task `scheduled`;
- scheduled → the trigger running in the triggerer ("trigger ... starting");
- trigger running → Ray job submitted (the job's `start_time`) → the step body starts;
- the body; body end → the Ray job ended (`end_time`) → the trigger saw the end ("... succeeded")
  → the event fired ("Trigger fired event": the result's XCom pushed) → the task `success` (the event
  handed to the triggerer's supervisor, the DB write);
- the last task's success → the run seen `success` by the 0.5 s REST poll.

The Ray jobs' own parts are split the same way where they exist (submit call → job created →
body → job ended → result in the caller).

    .venv/bin/python bench/chain_from_rest.py                      # its own demo cluster and Airflow
    RAYSLICE_HOME=/tmp/rs-dev-home .venv/bin/python bench/chain_from_rest.py --cluster dev
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import shutil
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from _common import ROOT, Report, Table, cluster, fmt_ratio, fmt_s, loadavg, log, median, parse_args

from rayslice.core.accelerators import AcceleratorRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local import airflow_ui, local_cluster

NAME = "chain_from_rest"
CHAIN_DAG = ROOT / "bench" / "airflow_dags" / "chain.py"
DAG_ID = "rayslice_bench_chain"
STEPS = 4
REQUEST = AcceleratorRequest(resource="GPU", count=0.25)
POLL_S = 0.5

#: The parts of an Airflow chain step, in order (first step's first part differs: see `_airflow_parts`).
PARTS = [
    "upstream success (first: run created) → task scheduled",
    "scheduled → trigger running",
    "trigger running → Ray job submitted",
    "Ray job submitted → step body start",
    "step body",
    "body end → Ray job ended",
    "Ray job ended → trigger saw it",
    "trigger saw the end → event fired (result XCom pushed)",
    "event fired → task success (triggerer loop, DB)",
]
#: The Ray jobs' parts that have a counterpart above.
JOB_PARTS = {
    "trigger running → Ray job submitted": "submit call → Ray job created",
    "Ray job submitted → step body start": "Ray job created → step body start",
    "step body": "step body",
    "body end → Ray job ended": "body end → Ray job ended",
    "Ray job ended → trigger saw it": "Ray job ended → result in the caller",
}


def _flags(parser) -> None:
    parser.add_argument("--examples", action="store_true",
                        help="serve rayslice's example DAGs beside the chain (`rayslice airflow up --examples`)")
    parser.add_argument("--idle-s", type=float, default=20, help="idle window for Airflow's own CPU (s)")
    parser.add_argument("--run-timeout", type=float, default=600, help="longest wait for one DAG run (s)")


def _ts(value: str | None) -> float | None:
    return None if not value else datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], default_reps=3, extra=_flags)
    report = Report(NAME, args)
    dags = Path(tempfile.mkdtemp(prefix="rs-bench-chain-dags-"))
    shutil.copy(CHAIN_DAG, dags / CHAIN_DAG.name)
    ui_name = f"bench-chain-{os.getpid()}"
    airflow_s: list[float] = []
    jobs_s: list[float] = []
    first: dict[str, list[float]] = collections.defaultdict(list)
    later: dict[str, list[float]] = collections.defaultdict(list)
    job_first: dict[str, list[float]] = collections.defaultdict(list)
    job_later: dict[str, list[float]] = collections.defaultdict(list)
    run_parts: dict[str, list[float]] = collections.defaultdict(list)
    with cluster(local_cluster.DEMO_SPEC, NAME) as record, contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, dags, True)
        started = time.monotonic()
        log(f"rayslice airflow up --dags {dags}{' --examples' if args.examples else ''} (cluster {record.name})")
        ui, _ = airflow_ui.up(ui_name, cluster=record.name, port=0, dags_folder=dags, examples=args.examples,
                              emit=log)
        stack.callback(airflow_ui.down, ui_name, keep_cluster=True)
        log(f"Airflow up in {time.monotonic() - started:.0f} s at {ui.url}")
        token = httpx.post(f"{ui.url}/auth/token", json={"username": ui.username, "password": ui.password},
                           timeout=60).json()["access_token"]
        api = stack.enter_context(httpx.Client(base_url=f"{ui.url}/api/v2", timeout=60,
                                               headers={"Authorization": f"Bearer {token}"}))
        ray = stack.enter_context(httpx.Client(
            base_url=record.dashboard_url, timeout=60,
            headers={"Authorization": f"Bearer {record.token}"} if record.token else {}))
        deadline = time.monotonic() + 180
        while api.get(f"/dags/{DAG_ID}").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the DAG processor did not register {DAG_ID}")
            time.sleep(1)
        idle_cpu = _idle_cpu(ui, args.idle_s)
        log("warm-up (unrecorded): one chain through Airflow, one as Ray jobs")
        _airflow_chain(api, ray, Path(ui.home), args)
        _jobs_chain(record, ray)
        for rep in range(args.reps):
            wall, parts, whole = _airflow_chain(api, ray, Path(ui.home), args)
            airflow_s.append(wall)
            for index, step in enumerate(parts):
                for part, value in step.items():
                    (first if index == 0 else later)[part].append(value)
            for part, value in whole.items():
                run_parts[part].append(value)
            wall_jobs, job_parts = _jobs_chain(record, ray)
            jobs_s.append(wall_jobs)
            for index, step in enumerate(job_parts):
                for part, value in step.items():
                    (job_first if index == 0 else job_later)[part].append(value)
            log(f"rep {rep + 1}: Airflow {wall:.2f} s, Ray jobs {wall_jobs:.2f} s ({wall / wall_jobs:.2f}×)")
    served = "the chain DAG's folder" + (" and the examples" if args.examples else "")
    report.note(f"- cluster: `local_cluster.DEMO_SPEC` (what `rayslice airflow up` starts); Airflow: "
                f"`rayslice.local.airflow_ui.up` serving {served}"
                f"\n- load average at the end: {loadavg()}"
                f"\n- Airflow's CPU while idle (no run), {args.idle_s:.0f} s window, CPU seconds per second: "
                + ", ".join(f"{k} {v:.3f}" for k, v in idle_cpu.items())
                + f" (scheduler_idle_sleep_time: {_idle_sleep_setting()} s)")
    report.add(_summary(airflow_s, jobs_s))
    report.add(_parts_table(first, later, job_first, job_later, run_parts))
    report.write()


def _idle_sleep_setting() -> str:
    """The scheduler's idle sleep `rayslice airflow up` applies (an older rayslice: Airflow's default, 1 s)."""
    if "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME" in os.environ:
        return os.environ["AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME"]
    return getattr(airflow_ui, "LATENCY_SETTINGS", {}).get("AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME", "1")


def _idle_cpu(ui: airflow_ui.UiRecord, seconds: float) -> dict[str, float]:
    """CPU seconds per second of each Airflow component (its whole session) over `seconds` with no run."""
    import psutil

    from rayslice.local.processes import session_members

    def cpu() -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = {}
        for component, leader in ui.sessions.items():
            out[component] = {}
            for pid in session_members({leader}):
                with contextlib.suppress(psutil.Error):
                    times = psutil.Process(pid).cpu_times()
                    out[component][pid] = times.user + times.system
        return out

    before = cpu()
    time.sleep(seconds)
    after = cpu()
    return {component: sum(after[component][pid] - before[component].get(pid, 0.0) for pid in after[component])
            / seconds for component in after}


def _summary(airflow_s: list[float], jobs_s: list[float]) -> Table:
    table = Table(f"A chain of four 1 s quarter-GPU steps (median of {len(airflow_s)}, alternating, same cluster)",
                  ["what", "median", "each", "ratio"])
    table.add("Airflow: REST trigger → REST reports success (0.5 s poll): what a user sees",
              fmt_s(median(airflow_s)), ", ".join(f"{v:.2f}" for v in airflow_s),
              fmt_ratio(median(airflow_s), median(jobs_s)))
    table.add("the same four steps as Ray jobs back to back (run_step_job)", fmt_s(median(jobs_s)),
              ", ".join(f"{v:.2f}" for v in jobs_s), "1.00×")
    return table


def _parts_table(first: dict, later: dict, job_first: dict, job_later: dict, run_parts: dict) -> Table:
    table = Table("Where a chain step's seconds go (median; later steps: steps 2-4 of every rep)",
                  ["part", "first step", "later steps", "Ray jobs: first", "Ray jobs: later", "whose"])
    whose = {
        PARTS[0]: "Airflow's scheduler loop (first: + the run's start)",
        PARTS[1]: "Airflow's triggerer loops (assign, then the runner's sync)",
        PARTS[2]: "rayslice's trigger: builds the step, XComs, submits",
        PARTS[3]: "Ray: job supervisor, driver, host process, imports",
        PARTS[4]: "the step",
        PARTS[5]: "Ray: the driver's exit seen by the job supervisor",
        PARTS[6]: "rayslice: the follow's status poll",
        PARTS[7]: "rayslice: the result's XCom push (a round trip through the triggerer's supervisor)",
        PARTS[8]: "Airflow: the runner hands events over once a second, then the DB write",
    }
    for part in PARTS:
        job_part = JOB_PARTS.get(part)
        table.add(part, fmt_s(_med(first[part])), fmt_s(_med(later[part])),
                  fmt_s(_med(job_first[job_part])) if job_part else "", fmt_s(_med(job_later[job_part]))
                  if job_part else "", whose[part])
    total_first = sum(_med(first[p]) or 0 for p in PARTS)
    total_later = sum(_med(later[p]) or 0 for p in PARTS)
    table.add("**sum**", fmt_s(total_first), fmt_s(total_later), "", "", "")
    table.notes = [f"{part}: {fmt_s(_med(values))}" for part, values in run_parts.items()]
    return table


def _med(values: list[float]) -> float | None:
    return median(values) if values else None


# ---------------------------------------------------------------------------------------------
# the chain through Airflow


def _airflow_chain(api: httpx.Client, ray: httpx.Client, home: Path, args: Any
                   ) -> tuple[float, list[dict[str, float]], dict[str, float]]:
    """Trigger the chain through REST, poll until REST says success; (wall, per-step parts, run parts)."""
    run_id = f"bench-chain-{time.time_ns()}"
    t0 = time.time()
    api.post(f"/dags/{DAG_ID}/dagRuns", json={"dag_run_id": run_id, "logical_date": None, "conf": {}}
             ).raise_for_status()
    posted = time.time()
    deadline = time.monotonic() + args.run_timeout
    state = None
    while state not in ("success", "failed"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"DAG run {run_id} still {state} after {args.run_timeout:.0f} s")
        time.sleep(POLL_S)
        resp = api.get(f"/dags/{DAG_ID}/dagRuns/{run_id}")
        state = resp.json().get("state") if resp.status_code == 200 else state
    seen = time.time()
    if state != "success":
        raise RuntimeError(f"DAG run {run_id} {state}")
    run = api.get(f"/dags/{DAG_ID}/dagRuns/{run_id}").json()
    tis = {ti["task_id"]: ti for ti in
           api.get(f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances").json()["task_instances"]}
    parts: list[dict[str, float]] = []
    previous_end = t0
    for index in range(STEPS):
        task = f"step_{index}"
        ti = tis[task]
        path = f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task}/xcomEntries"
        result = _xcom(api, f"{path}/return_value")
        sid = _xcom(api, f"{path}/ray_submission_id")
        job = ray.get(f"/api/jobs/{sid}").json()
        marks = _trigger_marks(home, run_id, task, sid)
        scheduled = _ts(ti.get("scheduled_when")) or _ts(ti["start_date"])
        end = _ts(ti["end_date"])
        step = {
            PARTS[0]: scheduled - previous_end,
            PARTS[1]: marks["starting"] - scheduled,
            PARTS[2]: job["start_time"] / 1000 - marks["starting"],
            PARTS[3]: result["start"] - job["start_time"] / 1000,
            PARTS[4]: result["end"] - result["start"],
            PARTS[5]: job["end_time"] / 1000 - result["end"],
            PARTS[6]: marks["succeeded"] - job["end_time"] / 1000,
            PARTS[7]: marks["fired"] - marks["succeeded"],
            PARTS[8]: end - marks["fired"],
        }
        parts.append(step)
        previous_end = end
    whole = {
        "the POST's own round trip": posted - t0,
        "DAG run created → the run running (scheduler)": (_ts(run.get("start_date")) or t0) - t0,
        "last task success → the run success (scheduler)": (_ts(run.get("end_date")) or previous_end) - previous_end,
        "the run success → seen by the 0.5 s REST poll": seen - (_ts(run.get("end_date")) or previous_end),
    }
    return seen - t0, parts, whole


def _xcom(api: httpx.Client, path: str) -> Any:
    resp = api.get(path, params={"deserialize": True})
    resp.raise_for_status()
    value = resp.json()["value"]
    with contextlib.suppress(TypeError, ValueError):
        return json.loads(value) if isinstance(value, str) and value[:1] in "{[\"" else value
    return value


def _trigger_marks(home: Path, run_id: str, task: str, sid: str) -> dict[str, float]:
    """When the trigger started and when it saw the job's end, from the task's trigger log (JSON lines)."""
    marks: dict[str, float] = {}
    for path in sorted((home / "logs").glob(f"dag_id={DAG_ID}/run_id={run_id}/task_id={task}/*trigger*")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            event, at = str(entry.get("event", "")), _ts(entry.get("timestamp"))
            if at is None:
                continue
            if event.startswith("trigger ") and event.endswith(" starting"):
                marks.setdefault("starting", at)
            elif f"Ray job {sid} succeeded" in event:
                marks.setdefault("succeeded", at)
            elif event == "Trigger fired event":
                marks.setdefault("fired", at)
    missing = {"starting", "succeeded", "fired"} - set(marks)
    if missing:
        raise RuntimeError(f"the trigger log of {task} in {run_id} has no {', '.join(sorted(missing))} line")
    return marks


# ---------------------------------------------------------------------------------------------
# the same four steps as Ray jobs back to back


def _jobs_chain(record: local_cluster.ClusterRecord, ray: httpx.Client) -> tuple[float, list[dict[str, float]]]:
    from airflow_dags.chain import one_second

    from rayslice.client.submission import run_step_job

    async def chain() -> list[tuple[float, float, str, dict]]:
        out, previous = [], None
        for index in range(STEPS):
            sid = f"bench-chain-job-{time.time_ns()}-{index}"
            spec = StepSpec.for_function(one_second, request=REQUEST, kwargs={"index": index, "previous": previous},
                                         owner=Owner(submission_id=sid))
            called = time.time()
            previous = await run_step_job(record.dashboard_url, spec, token=record.token, emit=lambda _: None)
            out.append((called, time.time(), sid, previous))
        return out

    t0 = time.time()
    steps = asyncio.run(chain())
    wall = steps[-1][1] - t0
    parts = []
    for called, returned, sid, result in steps:
        job = ray.get(f"/api/jobs/{sid}").json()
        parts.append({
            "submit call → Ray job created": job["start_time"] / 1000 - called,
            "Ray job created → step body start": result["start"] - job["start_time"] / 1000,
            "step body": result["end"] - result["start"],
            "body end → Ray job ended": job["end_time"] / 1000 - result["end"],
            "Ray job ended → result in the caller": returned - job["end_time"] / 1000,
        })
    return wall, parts


if __name__ == "__main__":
    main()
