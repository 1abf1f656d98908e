"""Reap from outside the cluster: stop rayslice jobs that outlived their Airflow task, then sweep leftovers.

Why this exists: a step's Ray job is independent of the Airflow worker that submitted it. When the
worker dies hard (SIGKILL, OOM, a lost machine) `on_kill` never runs, and the job keeps its slice
until the step ends on its own; Airflow later marks the task failed. A retry stops the previous
try's job itself, but with no retry left nothing would. Given Airflow's REST API, `reap` stops every
running rayslice job whose task instance Airflow reports finished (or moved on to a later try);
the job's end frees all it held. Only jobs of that Airflow's deployment are considered (each job's
metadata names it; the deployment is the `ray` connection's `deployment` extra, else that Airflow's
`rayslice_deployment` Variable, which `reap` reads when not told): a job of another Airflow on the
same cluster, with the same DAG, run and task names, is left alone, as is a job Airflow does not know.

Then it runs `python -m rayslice.cluster.reaper` as a small Ray job, which removes named
placement groups and actors of ended jobs. No `ray` import here.

A dry run changes nothing on the cluster: it submits no job and uploads no package. It stops no
job, and it lists the leftovers the sweep would remove from the dashboard's state API, with the
same rule (a `rayslice:` name whose creating Ray job has ended).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from rayslice.client import submission
from rayslice.client.jobs_client import AsyncRayJobsClient, JobDetails
from rayslice.core.exceptions import RaysliceError
from rayslice.core.step import DEPLOYMENT_VARIABLE, Owner

#: Task instance states in which the task may still be following its Ray job.
LIVE_TASK_STATES = frozenset({"running", "deferred", "queued", "scheduled", "up_for_reschedule", "restarting"})
SWEEP_ENTRYPOINT = "python -m rayslice.cluster.reaper"
STOP_WAIT_S = 25.0


@dataclass
class ReapReport:
    stopped: list[str] = field(default_factory=list)  # submission ids of jobs stopped (or to stop)
    reaped: list[dict[str, Any]] = field(default_factory=list)  # named leftovers removed by the sweep
    unknown_to_airflow: list[str] = field(default_factory=list)
    other_deployments: list[str] = field(default_factory=list)  # running jobs of other Airflows, left alone


class AirflowTasks:
    """Asks Airflow's REST API (v2) about one task instance."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=f"{url.rstrip('/')}/api/v2", headers=headers, timeout=timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def deployment(self) -> str:
        """This Airflow's deployment name, from its `rayslice_deployment` Variable."""
        resp = await self._http.get(f"/variables/{DEPLOYMENT_VARIABLE}")
        if resp.status_code == 404:
            raise RaysliceError(f"Airflow at {self._http.base_url} has no {DEPLOYMENT_VARIABLE!r} Variable (no step "
                                "ran there yet, or its `ray` connection names the deployment): give the deployment "
                                "with --deployment (the connection's 'deployment' extra)")
        if resp.status_code in (401, 403):
            raise RaysliceError(f"Airflow at {self._http.base_url} refused to show the {DEPLOYMENT_VARIABLE!r} "
                                f"Variable ({resp.status_code}): give the deployment with --deployment, or a token "
                                "of a user who may read Variables")
        resp.raise_for_status()
        return str(resp.json()["value"])

    async def task_instance(self, owner: Owner) -> dict[str, Any] | None:
        """The task instance as Airflow reports it; None when Airflow has no such task instance."""
        path = (f"/dags/{quote(owner.dag_id, safe='')}/dagRuns/{quote(owner.run_id, safe='')}"
                f"/taskInstances/{quote(owner.task_id, safe='')}")
        if owner.map_index >= 0:
            path += f"/{owner.map_index}"
        resp = await self._http.get(path)
        if resp.status_code == 404:
            return None
        if resp.status_code in (401, 403):
            raise RaysliceError(f"Airflow at {self._http.base_url} refused the reaper ({resp.status_code}): "
                                "give an API token of a user who may read task instances (--airflow-token)")
        resp.raise_for_status()
        return resp.json()


def owner_of(job: JobDetails) -> Owner | None:
    """The Airflow task instance a rayslice job was submitted for (from the job's metadata)."""
    owner = submission.owner_of(job)
    return owner if owner is not None and owner.dag_id else None


def task_has_ended(owner: Owner, task_instance: dict[str, Any]) -> bool:
    """Whether Airflow no longer follows this try: the instance finished, or a later try replaced it.

    A different task-instance id at the same try number is another instance altogether (the run was
    deleted and created again): this try has ended too.
    """
    later_try = task_instance.get("try_number")
    if isinstance(later_try, int) and later_try > owner.try_number:
        return True
    current_id = task_instance.get("id")
    if owner.ti_id and current_id and str(current_id) != owner.ti_id:
        return True
    return task_instance.get("state") not in LIVE_TASK_STATES


async def stop_abandoned_jobs(client: AsyncRayJobsClient, airflow: AirflowTasks, *, deployment: str, dry_run: bool,
                              report: ReapReport, emit: Callable[[str], None]) -> None:
    """Stop running rayslice jobs of `deployment` whose Airflow task has ended; wait until Ray reports them ended."""
    stopping = []
    for job in await client.list_jobs():
        owner = owner_of(job)
        if owner is None or job.is_terminal or not job.submission_id:
            continue
        if owner.deployment != deployment:
            report.other_deployments.append(job.submission_id)
            continue
        ti = await airflow.task_instance(owner)
        if ti is None:
            report.unknown_to_airflow.append(job.submission_id)
            continue
        if not task_has_ended(owner, ti):
            continue
        emit(f"{'would stop' if dry_run else 'stopping'} Ray job {job.submission_id}: Airflow task "
             f"{owner.dag_id}.{owner.task_id} try {owner.try_number} is {ti.get('state')} "
             f"(current try {ti.get('try_number')})")
        report.stopped.append(job.submission_id)
        if not dry_run:
            await client.stop(job.submission_id)
            stopping.append(job.submission_id)
    deadline = time.monotonic() + STOP_WAIT_S
    while stopping and time.monotonic() < deadline:
        stopping = [sid for sid in stopping if not (await client.get(sid)).is_terminal]
        await asyncio.sleep(0.2)
    for sid in stopping:
        emit(f"Ray job {sid} was stopped but has not ended after {STOP_WAIT_S:.0f} s")


#: The names the launcher gives every placement group and actor of a step (`rayslice.cluster.reaper.PREFIX`).
NAME_PREFIX = "rayslice:"
_STATE_QUERIES = {
    "placement_groups": {"filter_keys": "state", "filter_predicates": "!=", "filter_values": "REMOVED"},
    "actors": {"filter_keys": "state", "filter_predicates": "!=", "filter_values": "DEAD"},
}


def _state_rows(body: Any) -> list[dict[str, Any]]:
    result = body.get("data", {}).get("result", {}) if isinstance(body, dict) else {}
    return list(result.get("result") or []) if isinstance(result, dict) else []


async def find_leftovers(client: AsyncRayJobsClient) -> list[dict[str, Any]]:
    """What the sweep would remove, read from the dashboard only (GETs): `rayslice:` placement groups and
    actors still held whose creating Ray job has ended. A creator the Jobs API does not list counts as alive."""
    params = {"detail": "1", "limit": "10000"}
    groups, actors, jobs = await asyncio.gather(
        client.get_json("/api/v0/placement_groups", {**params, **_STATE_QUERIES["placement_groups"]}),
        client.get_json("/api/v0/actors", {**params, **_STATE_QUERIES["actors"]}),
        client.list_jobs(),
    )
    ended = {job.job_id for job in jobs if job.job_id and job.is_terminal}
    status = {job.submission_id: job.status.value for job in jobs if job.submission_id}
    found = [("placement_group", row.get("name") or "", row.get("creator_job_id"))
             for row in _state_rows(groups) if row.get("state") != "REMOVED"]
    found += [("actor", row.get("name") or "", row.get("job_id")) for row in _state_rows(actors)
              if row.get("state") != "DEAD"]
    leftovers = []
    for kind, name, creator in found:
        if name.startswith(NAME_PREFIX) and creator in ended:
            sid = name[len(NAME_PREFIX):].split("/", 1)[0]
            leftovers.append({"kind": kind, "name": name, "submission_id": sid,
                              "job_status": status.get(sid) or "ended (its driver exited)"})
    return leftovers


async def sweep(client: AsyncRayJobsClient, *, dry_run: bool) -> list[dict[str, Any]]:
    """Run the cluster-side sweep (`rayslice.cluster.reaper`) as a Ray job; the orphans it reaped.

    With `dry_run`, no job: the leftovers as the dashboard lists them (`find_leftovers`).
    """
    if dry_run:
        return await find_leftovers(client)
    py_modules = [await client.ensure_package(package) for package in submission.launcher_packages()]
    sid = await client.submit(SWEEP_ENTRYPOINT,
                              submission_id=f"rayslice-reap-{time.time_ns()}",
                              runtime_env={"py_modules": py_modules}, metadata={"rayslice-reap": "1"})
    return await submission.wait_for_step(client, sid, emit=lambda line: None, poll=0.5)


async def reap(address: str, *, token: str | None = None, airflow_url: str | None = None,
               airflow_token: str | None = None, deployment: str | None = None, dry_run: bool = False,
               emit: Callable[[str], None] = print) -> ReapReport:
    """Stop the jobs of ended tries of the Airflow at `airflow_url` (of `deployment`, else the one that
    Airflow's Variable names), then sweep the leftovers of ended jobs."""
    report = ReapReport()
    async with AsyncRayJobsClient(address, token=token) as client:
        if airflow_url:
            airflow = AirflowTasks(airflow_url, airflow_token)
            try:
                deployment = deployment or await airflow.deployment()
                await stop_abandoned_jobs(client, airflow, deployment=deployment, dry_run=dry_run, report=report,
                                          emit=emit)
            finally:
                await airflow.aclose()
        report.reaped = await sweep(client, dry_run=dry_run)
    for orphan in report.reaped:
        emit(f"{'would reap' if dry_run else 'reaped'} {orphan['kind']} {orphan['name']} "
             f"(its Ray job is {orphan['job_status']})")
    return report
