"""Turn a `StepSpec` into one Ray job, follow it, and read its result back: the Airflow side's core.

The job carries everything the cluster needs: the launcher (this package, plus cloudpickle)
as `py_modules`, and the step's `spec.json` as its `working_dir`, so a cluster whose image has
`ray` and `jax` but not `rayslice` still runs it. No `ray` import here.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import re
import time
import uuid
import zipfile
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path
from typing import Any

from rayslice.exceptions import (
    CapacityTimeoutError,
    HostLostError,
    InvalidRequestError,
    JobNotFoundError,
    PreemptedError,
    RaysliceError,
    RayUnreachableError,
    StepFailedError,
    StepTimeoutError,
    SubmissionConflictError,
    UnsatisfiableRequestError,
)
from rayslice.jobs_client import AsyncRayJobsClient, JobDetails, JobStatus, zip_directory
from rayslice.step import Owner, StepSpec, parse_error, parse_result

ENTRYPOINT = "python -m rayslice.launcher spec.json"
#: Ad-hoc steps (no Airflow task instance) get this prefix and a fresh UUID per submission.
ADHOC_PREFIX = "rayslice-adhoc-"
#: How long `wait_for_step` waits out an unreachable dashboard before it gives up on the job.
UNREACHABLE_GRACE_S = 300.0
_ERRORS: dict[str, type[RaysliceError]] = {
    cls.__name__: cls
    for cls in (
        CapacityTimeoutError,
        HostLostError,
        InvalidRequestError,
        PreemptedError,
        StepFailedError,
        StepTimeoutError,
        UnsatisfiableRequestError,
    )
}


def submission_id(owner: Owner) -> str:
    """A Ray submission id that only the same submitter finds again.

    An Airflow try's id holds a hash of its task-instance id, which Airflow 3 makes new for every
    try: the same try (a resumed deferral, a restarted worker or triggerer) finds its own job again
    and reattaches, while a re-created run reusing its run_id, or another Airflow on the same
    cluster, gets an id of its own. Without a task-instance id (an ad-hoc step) every call gives a
    fresh id; a caller that wants to reattach sets `owner.submission_id` itself.
    """
    if not owner.ti_id:
        return f"{ADHOC_PREFIX}{uuid.uuid4().hex}"
    key = f"{owner.dag_id}\0{owner.run_id}\0{owner.task_id}\0{owner.map_index}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    ti_digest = hashlib.sha1(owner.ti_id.encode()).hexdigest()[:8]
    readable = re.sub(r"[^A-Za-z0-9_-]+", "-", f"{owner.dag_id}--{owner.task_id}")[:80].strip("-")
    index = f"-m{owner.map_index}" if owner.map_index >= 0 else ""
    return f"rayslice-{readable}{index}-{digest}-try{owner.try_number}-{ti_digest}"


def owner_of(job: JobDetails) -> Owner | None:
    """The owner a rayslice job was submitted for, read back from its metadata; None for other jobs."""
    meta = job.metadata or {}
    if meta.get("rayslice") != "1":
        return None
    try:
        return Owner(dag_id=meta.get("dag_id", ""), run_id=meta.get("run_id", ""), task_id=meta.get("task_id", ""),
                     map_index=int(meta.get("map_index", -1)), try_number=int(meta.get("try_number", 0)),
                     ti_id=meta.get("ti_id", ""), submission_id=job.submission_id or "")
    except ValueError:
        return None


def jobs_of_task(jobs: Iterable[JobDetails], owner: Owner) -> list[JobDetails]:
    """The rayslice jobs of `owner`'s (dag, run, task, map index), of every try and status.

    Found by metadata, not by id: ids hold each try's task-instance id, which only that try knows.
    """
    return [job for job, _ in _with_task_owners(jobs, owner)]


def running_earlier_tries(jobs: Iterable[JobDetails], owner: Owner) -> dict[str, int]:
    """Submission id -> try number of each still-running job of `owner`'s task from a try before its own."""
    return {job.submission_id or "": theirs.try_number for job, theirs in _with_task_owners(jobs, owner)
            if not job.is_terminal and theirs.try_number < owner.try_number and job.submission_id}


def _with_task_owners(jobs: Iterable[JobDetails], owner: Owner) -> list[tuple[JobDetails, Owner]]:
    task = (owner.dag_id, owner.run_id, owner.task_id, owner.map_index)
    found = []
    for job in jobs:
        theirs = owner_of(job)
        if theirs is not None and theirs.dag_id and (theirs.dag_id, theirs.run_id, theirs.task_id,
                                                     theirs.map_index) == task:
            found.append((job, theirs))
    return found


def _identity(owner: Owner) -> tuple[str, str, str, int, int, str]:
    return owner.dag_id, owner.run_id, owner.task_id, owner.map_index, owner.try_number, owner.ti_id


def _describe(owner: Owner | None) -> str:
    if owner is None:
        return "a job that rayslice did not submit"
    if not owner.dag_id:
        return "an ad-hoc step" + (f" (task instance {owner.ti_id})" if owner.ti_id else "")
    index = f"[{owner.map_index}]" if owner.map_index >= 0 else ""
    return (f"Airflow task {owner.dag_id}.{owner.task_id}{index} of run {owner.run_id}, try {owner.try_number} "
            f"(task instance {owner.ti_id or 'unknown'})")


def _check_reattachable(job: JobDetails, owner: Owner) -> None:
    """A job is reattached only by the submitter that made it: same owner, task-instance id included."""
    theirs = owner_of(job)
    if theirs is not None and _identity(theirs) == _identity(owner):
        return
    raise SubmissionConflictError(
        f"Ray job {job.submission_id} already exists and belongs to {_describe(theirs)}, not to {_describe(owner)}: "
        "only the submitter of a job reattaches to it. Leave the submission id empty to get a fresh one, "
        "or choose an id that no job on this cluster has"
    )


@cache
def launcher_packages() -> tuple[bytes, ...]:
    """The launcher code as `py_modules` zips: the rayslice core, and cloudpickle for by-value steps."""
    import cloudpickle

    core = Path(__file__).parent
    return (
        zip_directory(core, include_parent_dir=True),
        zip_directory(Path(cloudpickle.__file__).parent, include_parent_dir=True),
    )


def spec_package(spec: StepSpec) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        info = zipfile.ZipInfo("spec.json", date_time=(1980, 1, 1, 0, 0, 0))
        zf.writestr(info, spec.model_dump_json())
    return buf.getvalue()


async def submit_step(
    client: AsyncRayJobsClient, spec: StepSpec, *, emit: Callable[[str], None] = print
) -> str:
    """Submit the step as a Ray job, or reattach to the job this same try (or caller) submitted before.

    The job's metadata names its owner, task-instance id included; that is what decides whether an
    existing job of the same id may be reattached (see `submission_id`). Returns the submission id.
    """
    if not spec.owner.submission_id:
        owner = spec.owner.model_copy(update={"submission_id": submission_id(spec.owner)})
        spec = spec.model_copy(update={"owner": owner})
    sid = spec.owner.submission_id
    try:
        existing: JobDetails | None = await client.get(sid)
    except JobNotFoundError:
        existing = None
    if existing is not None:
        _check_reattachable(existing, spec.owner)
        submitter = "this try" if spec.owner.ti_id else "this caller"
        emit(f"[rayslice] reattaching to Ray job {sid} that {submitter} submitted ({existing.status.value})")
        return sid
    py_modules = [await client.ensure_package(package) for package in launcher_packages()]
    working_dir = await client.ensure_package(spec_package(spec))
    owner = spec.owner.model_dump(mode="json")
    # Idempotent by id: a retried POST whose first answer was lost finds its own job.
    await client.submit(
        ENTRYPOINT,
        submission_id=sid,
        # Every host's lines in the task log, not Ray's "[repeated 3x across cluster]" digest.
        runtime_env={
            "py_modules": py_modules,
            "working_dir": working_dir,
            "env_vars": {"RAY_DEDUP_LOGS": "0"},
        },
        metadata={"rayslice": "1", "request": str(spec.request), **{k: str(v) for k, v in owner.items()}},
    )
    emit(f"[rayslice] submitted {spec.request} as Ray job {sid}")
    return sid


class LogFollower:
    """Hands each new line of a job's log to `emit`, once, across polls."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit
        self.seen = 0

    def feed(self, log: str) -> None:
        new, self.seen = log[self.seen :], len(log)
        for line in new.splitlines():
            if line.strip() and not line.startswith(("::rayslice-result::", "::rayslice-error::")):
                self.emit(_strip_ansi(line))


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def outcome(job: JobDetails, log: str) -> Any:
    """The step's result for a finished job, or the error that says why it did not succeed."""
    if job.status == JobStatus.SUCCEEDED:
        found, value = parse_result(log)
        if not found:
            raise StepFailedError(f"Ray job {job.submission_id} succeeded but printed no rayslice result")
        return value
    error = parse_error(log)
    if error:
        raise _ERRORS.get(error["type"], StepFailedError)(error["message"])
    if job.status == JobStatus.STOPPED:
        raise StepFailedError(f"Ray job {job.submission_id} was stopped before the step finished")
    raise StepFailedError(f"Ray job {job.submission_id} {job.status.value}: {job.message or 'no message'}")


async def wait_for_step(
    client: AsyncRayJobsClient,
    sid: str,
    *,
    emit: Callable[[str], None] = print,
    poll: float = 1.0,
    unreachable_grace: float = UNREACHABLE_GRACE_S,
) -> Any:
    """Follow the job to its end, relaying its log; return the step's result or raise its error.

    The job runs on without us: a dashboard outage shorter than `unreachable_grace` is waited
    out; a longer one raises an error that names the job, which may still be running.
    """
    follower = LogFollower(emit)
    unreachable_since: float | None = None
    while True:
        try:
            job = await client.get(sid)
            log = await client.logs(sid)
        except RayUnreachableError as exc:
            unreachable_since = unreachable_since or time.monotonic()
            if time.monotonic() - unreachable_since > unreachable_grace:
                raise RayUnreachableError(
                    f"lost the Ray dashboard for over {unreachable_grace:.0f} s while following Ray job {sid}, "
                    f"which may still be running (stop it with `ray job stop {sid}`): {exc}",
                    status_code=exc.status_code,
                ) from None
            emit(f"[rayslice] Ray dashboard not answering ({exc}); still following {sid}")
            await asyncio.sleep(poll)
            continue
        unreachable_since = None
        follower.feed(log)
        if job.status.is_terminal:
            return outcome(job, log)
        await asyncio.sleep(poll)


async def run_step_job(
    address: str,
    spec: StepSpec,
    *,
    token: str | None = None,
    emit: Callable[[str], None] = print,
    submission_id: str | None = None,
) -> Any:
    """Submit, follow and return: the whole round trip, for the CLI and non-deferred operators.

    Each call runs the step afresh, unless `submission_id` (or `spec.owner.submission_id`) names a
    job this caller submitted before: then it follows that job to its result.
    """
    if submission_id:
        spec = spec.model_copy(update={"owner": spec.owner.model_copy(update={"submission_id": submission_id})})
    async with AsyncRayJobsClient(address, token=token) as client:
        sid = await submit_step(client, spec, emit=emit)
        try:
            return await wait_for_step(client, sid, emit=emit)
        except asyncio.CancelledError:
            await client.stop(sid)
            raise
