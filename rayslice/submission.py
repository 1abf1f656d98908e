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
import zipfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from rayslice.exceptions import (
    CapacityTimeoutError,
    HostLostError,
    InvalidRequestError,
    PreemptedError,
    RaysliceError,
    RayUnreachableError,
    StepFailedError,
    StepTimeoutError,
    UnsatisfiableRequestError,
)
from rayslice.jobs_client import AsyncRayJobsClient, JobDetails, JobStatus, zip_directory
from rayslice.step import Owner, StepSpec, parse_error, parse_result

ENTRYPOINT = "python -m rayslice.launcher spec.json"
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
    """Stable per (dag, run, task, map index, try): a resumed or restarted try reattaches to its job."""
    key = f"{owner.dag_id}\0{owner.run_id}\0{owner.task_id}\0{owner.map_index}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    readable = re.sub(r"[^A-Za-z0-9_-]+", "-", f"{owner.dag_id}--{owner.task_id}")[:80].strip("-")
    index = f"-m{owner.map_index}" if owner.map_index >= 0 else ""
    return f"rayslice-{readable}{index}-{digest}-try{owner.try_number}"


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


async def submit_step(client: AsyncRayJobsClient, spec: StepSpec) -> str:
    """Submit the step as a Ray job (or find the one already submitted under its id)."""
    if not spec.owner.submission_id:
        owner = spec.owner.model_copy(update={"submission_id": submission_id(spec.owner)})
        spec = spec.model_copy(update={"owner": owner})
    sid = spec.owner.submission_id
    py_modules = [await client.ensure_package(package) for package in launcher_packages()]
    working_dir = await client.ensure_package(spec_package(spec))
    owner = spec.owner.model_dump(mode="json")
    return await client.submit(
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
    address: str, spec: StepSpec, *, token: str | None = None, emit: Callable[[str], None] = print
) -> Any:
    """Submit, follow and return: the whole round trip, for the CLI and non-deferred operators."""
    async with AsyncRayJobsClient(address, token=token) as client:
        sid = await submit_step(client, spec)
        try:
            return await wait_for_step(client, sid, emit=emit)
        except asyncio.CancelledError:
            await client.stop(sid)
            raise
