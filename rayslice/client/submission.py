"""Turn a `StepSpec` into one Ray job, follow it, and read its result back: the Airflow side's core.

The job carries everything the cluster needs: the launcher (this package, plus cloudpickle)
as `py_modules`, and the step's `spec.json` as its `working_dir`, so a cluster whose image has
`ray` and `jax` but not `rayslice` still runs it. A cluster whose image has this rayslice
(`launcher="installed"`) gets the spec alone, and its host processes start without a runtime
env (see `rayslice.cluster.__main__`). No `ray` import here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
import re
import secrets
import time
import uuid
import zipfile
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from rayslice.client.jobs_client import AsyncRayJobsClient, JobDetails, JobStatus, LogTail, zip_directory
from rayslice.client.uploads import upload_runtime_env
from rayslice.core import launcher
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.exceptions import (
    STEP_ERRORS,
    InvalidRequestError,
    JobNotFoundError,
    RayJobsError,
    RayUnreachableError,
    StepFailedError,
    SubmissionConflictError,
)
from rayslice.core.step import (
    ERROR_MARKER,
    GOODPUT_RECORD_MARKER,
    HOST_DONE_MARKER,
    MARKER_TAG_KEY,
    PHASES_MARKER,
    RESULT_MARKER,
    Owner,
    StepSpec,
    error_marker,
    parse_error,
    parse_result,
    result_marker,
)

ENTRYPOINT = "python -m rayslice.cluster spec.json"
#: Ad-hoc steps (no Airflow task instance) get this prefix and a fresh UUID per submission.
ADHOC_PREFIX = "rayslice-adhoc-"
#: How long `wait_for_step` waits out an unreachable dashboard before it gives up on the job.
UNREACHABLE_GRACE_S = 300.0


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
                     deployment=meta.get("deployment", ""), ti_id=meta.get("ti_id", ""),
                     submission_id=job.submission_id or "")
    except ValueError:
        return None


def jobs_of_task(jobs: Iterable[JobDetails], owner: Owner) -> list[JobDetails]:
    """The rayslice jobs of `owner`'s (deployment, dag, run, task, map index), of every try and status.

    Found by metadata, not by id: ids hold each try's task-instance id, which only that try knows.
    An owner without a deployment (a tool looking at the whole cluster) finds the task's jobs of
    every Airflow deployment.
    """
    return [job for job, _ in _with_task_owners(jobs, owner, every_deployment=not owner.deployment)]


def running_earlier_tries(jobs: Iterable[JobDetails], owner: Owner) -> dict[str, int]:
    """Submission id -> try number of each still-running job of `owner`'s task from a try before its own.

    Only jobs of `owner`'s own Airflow deployment: another Airflow's task of the same name is not an earlier try.
    """
    return {job.submission_id or "": theirs.try_number for job, theirs in _with_task_owners(jobs, owner)
            if not job.is_terminal and theirs.try_number < owner.try_number and job.submission_id}


def _with_task_owners(jobs: Iterable[JobDetails], owner: Owner, *,
                      every_deployment: bool = False) -> list[tuple[JobDetails, Owner]]:
    task = (owner.dag_id, owner.run_id, owner.task_id, owner.map_index)
    found = []
    for job in jobs:
        theirs = owner_of(job)
        if theirs is not None and theirs.dag_id and (theirs.dag_id, theirs.run_id, theirs.task_id,
                                                     theirs.map_index) == task \
                and (every_deployment or theirs.deployment == owner.deployment):
            found.append((job, theirs))
    return found


def _identity(owner: Owner) -> tuple[str, str, str, str, int, int, str]:
    return (owner.deployment, owner.dag_id, owner.run_id, owner.task_id, owner.map_index, owner.try_number,
            owner.ti_id)


def _describe(owner: Owner | None) -> str:
    if owner is None:
        return "a job that rayslice did not submit"
    if not owner.dag_id:
        return "an ad-hoc step" + (f" (task instance {owner.ti_id})" if owner.ti_id else "")
    index = f"[{owner.map_index}]" if owner.map_index >= 0 else ""
    return (f"Airflow task {owner.dag_id}.{owner.task_id}{index} of run {owner.run_id}, try {owner.try_number} "
            f"(task instance {owner.ti_id or 'unknown'}, deployment {owner.deployment or 'unnamed'})")


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
    """The launcher as `py_modules` zips: rayslice's cluster side only, and cloudpickle for by-value steps."""
    import cloudpickle

    package = Path(__file__).parents[1]
    return (
        zip_directory(package, include=launcher.is_cluster_side, include_parent_dir=True),
        zip_directory(Path(cloudpickle.__file__).parent, include_parent_dir=True),
    )


def spec_package(spec: StepSpec) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        info = zipfile.ZipInfo("spec.json", date_time=(1980, 1, 1, 0, 0, 0))
        zf.writestr(info, spec.model_dump_json())
    return buf.getvalue()


async def submit_step(
    client: AsyncRayJobsClient, spec: StepSpec, *, emit: Callable[[str], None] = print,
    on_reattach: Callable[[JobDetails], None] | None = None,
) -> str:
    """Submit the step as a Ray job, or reattach to the job this same try (or caller) submitted before.

    The job's metadata names its owner, task-instance id included; that is what decides whether an
    existing job of the same id may be reattached (see `submission_id`). Returns the submission id.
    `on_reattach` is told the existing job when there was one (a follower then resumes where an earlier
    one left off, rather than at the log's start).
    """
    if not spec.owner.submission_id:
        owner = spec.owner.model_copy(update={"submission_id": submission_id(spec.owner)})
        spec = spec.model_copy(update={"owner": owner})
    if not spec.marker_tag:  # the driver's marker lines carry it; text a step prints does not
        spec = spec.model_copy(update={"marker_tag": secrets.token_hex(8)})
    sid = spec.owner.submission_id
    try:
        existing: JobDetails | None = await client.get(sid)
    except JobNotFoundError:
        existing = None
    if existing is not None:
        _check_reattachable(existing, spec.owner)
        submitter = "this try" if spec.owner.ti_id else "this caller"
        emit(f"[rayslice] reattaching to Ray job {sid} that {submitter} submitted ({existing.status.value})")
        if on_reattach is not None:
            on_reattach(existing)
        return sid
    if spec.runtime_env:  # the step's own code: uploaded once per content, the spec carries its URIs
        spec = spec.model_copy(update={"runtime_env": await upload_runtime_env(client, spec.runtime_env)})
    # Every host's lines in the task log, not Ray's "[repeated 3x across cluster]" digest.
    runtime_env: dict[str, Any] = {"working_dir": await client.ensure_package(spec_package(spec)),
                                   "env_vars": {"RAY_DEDUP_LOGS": "0"}}
    if spec.launcher == "shipped":
        runtime_env["py_modules"] = [await client.ensure_package(package) for package in launcher_packages()]
    owner = spec.owner.model_dump(mode="json")
    # Idempotent by id: a retried POST whose first answer was lost finds its own job.
    await client.submit(
        ENTRYPOINT,
        submission_id=sid,
        runtime_env=runtime_env,
        metadata={"rayslice": "1", "request": str(spec.request), **{k: str(v) for k, v in owner.items()},
                  MARKER_TAG_KEY: spec.marker_tag, "priority": str(spec.priority or 0),
                  **({"team": spec.team} if spec.team else {}),
                  # A step over several clusters: the set's views find its job on the other members (standing by).
                  **({"cluster_set": spec.cluster_set.name, "cluster": spec.cluster_set.member}
                     if spec.cluster_set is not None else {})},
    )
    emit(f"[rayslice] submitted {spec.request} as Ray job {sid}")
    return sid


class LogFollower:
    """Hands each line of a job's log to `emit` once, across streams that each start at the log's beginning.

    `offset` is the number of characters of the log up to the end of the last whole line handled
    (relayed, or skipped as a marker or blank): a new stream skips that much, and a restarted
    trigger resumes from it. A line is relayed once its newline has arrived (or the log ended), so
    a line a chunk cut in two is relayed whole. The step's marker lines are kept, not relayed.

    Bounded reads of the log's last lines (`window`) carry no offset: they are placed by the
    digests of the last `RECENT_LINES` lines handled, which `state()` also returns for a restart.
    """

    #: How many of the last lines handled are remembered (as digests) to place a window of the log's end.
    RECENT_LINES = 32

    def __init__(self, emit: Callable[[str], None], offset: int = 0, recent: Iterable[str] = (),
                 tag: str = "", markers: Mapping[str, str] | None = None,
                 show_gloo_connects: bool | None = None) -> None:
        self.emit = emit
        # gloo's "Rank N is connected to M peer ranks" from every host of a simulated slice (`_GLOO_CONNECT_LINE`):
        # hidden unless asked for, here or by $RAYSLICE_SHOW_GLOO_CONNECTS.
        self.show_gloo_connects = (_env_flag(SHOW_GLOO_CONNECTS_ENV) if show_gloo_connects is None
                                   else show_gloo_connects)
        self.offset = int(offset)
        self._recent: deque[str] = deque(recent, maxlen=self.RECENT_LINES)
        self.tag = tag  # the job's marker tag (`marker_tag`): set from its metadata before its log is read
        self._partial = ""  # the current stream's text past `offset` that has no newline yet
        self._received = 0  # characters of the current stream seen so far
        # The last line carrying each marker; a restart gets them back with the offset (`state`): a follower
        # resumed past the result line must still know the result.
        self._markers: dict[str, str] = dict(markers or {})
        self.handled = 0  # whole lines handled by this follower

    @property
    def held(self) -> int:
        """Characters of the log this follower holds: up to `offset`, and the current unfinished line."""
        return self.offset + len(self._partial)

    @property
    def seen(self) -> int:  # the name the trigger's events and older callers use
        return self.offset

    @seen.setter
    def seen(self, value: int) -> None:
        self.offset = int(value)

    @property
    def markers(self) -> str:
        """The last result and error marker lines seen: all `outcome` needs of the log."""
        return "\n".join(self._markers.values())

    def state(self) -> dict[str, Any]:
        """Where relaying stands: enough for a restarted follower to relay nothing twice (`LogFollower(**state)`)."""
        return {"offset": self.offset, "recent": list(self._recent), "markers": dict(self._markers)}

    def restart(self) -> None:
        """A new stream begins, from the log's first character."""
        self._partial, self._received = "", 0

    def chunk(self, text: str) -> None:
        """The next piece of the current stream."""
        start, self._received = self._received, self._received + len(text)
        skip = self.offset + len(self._partial) - start  # what this follower already holds
        if skip >= len(text):
            return
        pending = self._partial + text[max(0, skip):]
        *lines, self._partial = pending.split("\n")
        for line in lines:
            self._line(line)

    def feed(self, log: str) -> None:
        """The whole log so far, as `GET .../logs` returns it."""
        self.restart()
        self.chunk(log)

    def window(self, text: str, asked: int, *, ended: bool = False, only_if_placed: bool = False,
               whole_only: bool = False) -> bool:
        """The log's last lines, read with a bounded read of at most `asked` lines: relay those not handled yet.

        A window that holds the whole log (fewer lines than asked) is placed at `offset`, once the
        lines before it are the last ones handled: the digests alone would place a log of repeated
        lines after their last run, and lose the rest. A window cut short is placed by the last
        lines handled (with `whole_only`, it is not placed). False when it could not be placed:
        lines before it may be missing (with `only_if_placed`, nothing is relayed then). With
        `ended`, the log is complete and a last line without a newline is relayed too.
        """
        *lines, last = text.split("\n")
        digests = [_digest(line) for line in lines]
        # Ray's state API counts an unfinished last line as one of the lines asked for.
        whole = len(lines) + bool(last) < asked
        start = self._place_at_offset(lines, digests) if whole else None
        if start is None and not whole_only:
            start = self._place(digests)
        placed = start is not None
        if not placed and (only_if_placed or whole_only):
            return False
        self.restart()  # a stream's unfinished line is read whole here
        for line in lines[start or 0:]:
            self._line(line)
        if ended:
            self._partial, self._received = last, self.offset + len(last)
            self.flush()
        return placed

    def flush(self) -> None:
        """The log ended: relay its last line even without a newline."""
        line, self._partial = self._partial, ""
        self.offset += len(line)
        self._received = self.offset
        if line:
            self._recent.append(_digest(line))
        self._handle(line)

    def _place_at_offset(self, lines: list[str], digests: list[str]) -> int | None:
        """Index of the line at `offset` in a window holding the whole log; None unless the lines before it
        are the last ones handled (a follower that holds no digests is placed only at the log's start)."""
        at, start = 0, None
        for index, line in enumerate(lines):
            if at == self.offset:
                start = index
                break
            at += len(line) + 1
        else:
            start = len(lines) if at == self.offset else None
        if start is None:
            return None
        recent = list(self._recent)
        if len(recent) > start or digests[start - len(recent):start] != recent:
            return None
        if not recent and start:
            return None
        return start

    def _place(self, digests: list[str]) -> int | None:
        """Index of the first line after the last lines handled, in a window's lines; None if they are not in it."""
        recent = list(self._recent)
        if not recent:
            return None
        for end in range(len(digests) - 1, -1, -1):  # the latest match: never relay a line twice
            n = min(len(recent), end + 1)
            if digests[end + 1 - n:end + 1] == recent[len(recent) - n:]:
                return end + 1
        return None

    def _line(self, line: str) -> None:
        self.handled += 1
        self.offset += len(line) + 1
        self._recent.append(_digest(line))
        self._handle(line)

    def _handle(self, line: str) -> None:
        if line.startswith((PHASES_MARKER, GOODPUT_RECORD_MARKER)):  # records: the Ray job's log keeps them
            return
        # Only the driver's own marker lines count: they start the line (see `parse_result`);
        # a marker anywhere else (a host's line, after a "\r") is the step's text, relayed as such.
        for kind, marker in ((RESULT_MARKER, result_marker(self.tag)), (ERROR_MARKER, error_marker(self.tag))):
            if line.startswith(marker):
                self._markers[kind] = line
                return
        for piece in line.splitlines():  # "\r" progress bars and the like: one line each, as before
            text = _strip_ansi(piece)
            if not piece.strip() or _HOST_DONE_LINE.match(text):
                continue
            if not self.show_gloo_connects and _is_gloo_connect(text):
                continue
            self.emit(text)


#: A host's last line, `(label pid=...) ::rayslice-host-done::label`: kept out of the task log.
_HOST_DONE_LINE = re.compile(r"^\(.*\) " + re.escape(HOST_DONE_MARKER) + r"\S")
#: gloo's line as a host joins the simulated slice's CPU collectives (JAX on CPU, `cluster/environments.py`),
#: `(v6e-16-a/host0 pid=123) [Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer
#: ranks is : 3`: one per host and JAX group, some 80 lines for the demo's three slice steps, and none on a
#: real TPU (JAX does not use gloo there), so it tells a user nothing about their program. Only this exact
#: line, only from a host (Ray's `(label pid=N[, ip=...])` prefix): a host's other gloo lines (its errors)
#: and the same text printed anywhere else are relayed.
_GLOO_CONNECT_LINE = re.compile(r"^\([^()]* pid=\d+(?:, ip=[^()]*)?\) "
                                r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\."
                                r"(?: Expected number of connected peer ranks is : \d+)?\s*$")
#: A host line's text after its Ray prefix, and the words of gloo's connection line: a host joining two JAX
#: groups at once gets two such lines written into each other (`[Gloo] Rank [Gloo] Rank 7 is connected ...`).
_HOST_PREFIX = re.compile(r"^\([^()]* pid=\d+(?:, ip=[^()]*)?\) ")
_GLOO_WORDS = frozenset({"[Gloo]", "Rank", "is", "connected", "to", "peer", "ranks", "Expected", "number", "of",
                         ".", ":"})
_GLOO_PIECE = re.compile(r"\[Gloo\]|[A-Za-z]+|\d+|\S")


def _is_gloo_connect(text: str) -> bool:
    """gloo's connection line from a host, whole (`_GLOO_CONNECT_LINE`) or in pieces of two written into each
    other: every word of the text past the host's prefix is one of that line's, and it says "connected" or
    "peer". A host line with any word of its own (its program's, gloo's errors) is relayed."""
    if _GLOO_CONNECT_LINE.match(text):
        return True
    prefix = _HOST_PREFIX.match(text)
    if prefix is None:
        return False
    pieces = _GLOO_PIECE.findall(text[prefix.end():])
    return (bool({"connected", "peer"} & set(pieces))
            and all(piece in _GLOO_WORDS or piece.isdigit() for piece in pieces))


#: Set to 1 to relay gloo's connection lines too (`LogFollower(show_gloo_connects=...)` overrides it).
SHOW_GLOO_CONNECTS_ENV = "RAYSLICE_SHOW_GLOO_CONNECTS"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _digest(line: str) -> str:
    return hashlib.blake2b(line.encode("utf-8", "replace"), digest_size=8).hexdigest()


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def marker_tag_of(job: JobDetails) -> str:
    """The tag of the job's marker lines; "" for a job submitted without one (plain markers)."""
    return str((job.metadata or {}).get(MARKER_TAG_KEY, ""))


def outcome(job: JobDetails, log: str) -> Any:
    """The step's result for a finished job, or the error that says why it did not succeed.

    `log` needs only the marker lines (`LogFollower.markers`); the whole log works too.
    """
    tag = marker_tag_of(job)
    if job.status == JobStatus.SUCCEEDED:
        found, value = parse_result(log, tag)
        if not found:
            raise StepFailedError(f"Ray job {job.submission_id} succeeded but printed no rayslice result")
        return value
    error = parse_error(log, tag)
    if error:
        kind = STEP_ERRORS.get(error["type"], StepFailedError)
        fields = error["fields"] if issubclass(kind, StepFailedError) else {}
        raise kind(error["message"], **fields)
    if job.status == JobStatus.STOPPED:
        raise StepFailedError(f"Ray job {job.submission_id} was stopped before the step finished")
    message = job.message or "no message"
    if "No module named 'rayslice" in message:  # `python -m rayslice.cluster` found no rayslice
        message += ("\nThe cluster has no rayslice for a job that expects it installed: install this rayslice in "
                    "the cluster's image, or set the `ray` connection's extra 'launcher' to 'shipped'")
    raise StepFailedError(f"Ray job {job.submission_id} {job.status.value}: {message}")


class JobFollow:
    """Follows one job to its end: polls its (small) status, streams its log over the websocket tail.

    The log is never re-downloaded per poll. A stream (`client.tail_logs`) is opened once the job
    left PENDING (Ray may close one opened earlier at once, with nothing) and reopened, at most
    once per `poll`, whenever it ends before the log is known complete; each stream re-sends the
    log from its start, and `lines` skips what it already holds. The job's end is seen by polling
    `client.get` every `poll` seconds.

    The log is complete once a stream closed normally after the job ended: a stream open when a
    poll saw the end, or one opened after the end, or one that delivered the step's marker line.
    A stream that breaks off (a cut connection) is reopened at the next poll; one that stays open
    `END_GRACE_S` after the end is closed and the rest read with a bounded read of the log's last
    lines (`client.log_lines`) once such a read reaches back to the last line relayed (until then
    the stream goes on; one that made no progress for `END_GRACE_S` is reopened). Status polls that
    fail for longer than `unreachable_grace` raise `RayUnreachableError` naming the job; stream
    failures alone never do.

    Without a stream (a proxy that does not pass websockets: `STREAM_ATTEMPTS` opens in a row that
    failed or gave nothing), the log is followed by polling: each poll reads the status and the
    log's last lines, half as many again as the previous read found new, plus `MIN_WINDOW` (a read
    that does not reach the last line relayed is repeated with twice the lines): what is read stays
    near the log's own size, and the whole log is never held.

    The step's marker line is the launcher's last line, and its driver exits right after it: once
    it arrived, the status is polled every `MARKER_POLL_S`, and once the job ended the open stream
    is read until it has been quiet for `QUIET_S`, then closed (the dashboard keeps a stream open
    for seconds after the end): the caller gets the result without waiting out either. A poll that
    sees the end before the stream brought the marker (the dashboard streams new lines a second or
    more late) reads the log's end at once, once; that read completes the log only if it holds the
    whole log (`FIRST_WINDOW` lines at most), placed at the offset relayed up to.
    """

    #: How long a stream may stay open after the job ended before the rest is read with a bounded read.
    END_GRACE_S = 15.0
    #: The status poll interval once the marker line arrived (for at most MARKER_FAST_S).
    MARKER_POLL_S = 0.1
    MARKER_FAST_S = 10.0
    #: After the end, with the marker line relayed: this much stream silence completes the log.
    QUIET_S = 0.3
    #: Stream opens in a row that fail (or give nothing) before the log is followed by polling instead.
    STREAM_ATTEMPTS = 3
    #: Lines per bounded read of the log's end: the first read, the least, and the most.
    FIRST_WINDOW = 1000
    MIN_WINDOW = 20
    MAX_WINDOW = 8000

    def __init__(
        self,
        client: AsyncRayJobsClient,
        sid: str,
        lines: LogFollower,
        *,
        poll: float = 1.0,
        call_timeout: float = 30.0,
        unreachable_grace: float = UNREACHABLE_GRACE_S,
        warn: Callable[[str], None] = print,
    ) -> None:
        self.client, self.sid, self.lines = client, sid, lines
        self.poll, self.call_timeout, self.unreachable_grace = poll, call_timeout, unreachable_grace
        self.warn = warn
        self.job: JobDetails | None = None  # the last status read
        self.complete = False  # the whole log went through `lines`
        self.streams = 0  # log streams opened
        self.polling = False  # following by polling: the stream is unavailable
        self.window_reads = 0  # bounded reads of the log's end
        self._failed_streams = 0  # stream opens in a row that failed or gave nothing
        self._window = self.FIRST_WINDOW
        self._unreachable_since: float | None = None
        self._stream_trouble = False  # warned about the stream; warned again only after it worked

    def outcome(self) -> Any:
        """The step's result or error, from the marker lines (once `statuses()` has ended)."""
        if self.job is None or not self.complete:
            raise RuntimeError(f"Ray job {self.sid} is still being followed")
        return outcome(self.job, self.lines.markers)

    async def statuses(self) -> AsyncIterator[JobDetails]:
        """Yield each status read, until the job ended and its whole log went through `lines`.

        Then `self.job` is the final status. A caller may stop iterating at any time (a deadline):
        the open stream, if any, is closed.
        """
        async with contextlib.aclosing(self._streaming()) as streamed:
            async for job in streamed:
                yield job
        if self.polling:
            async for job in self._polling():
                yield job
        self.lines.flush()
        self.complete = True

    async def _streaming(self) -> AsyncIterator[JobDetails]:
        """Follow over the log stream; returns once the log is complete, or when it falls back to `polling`."""
        async with contextlib.AsyncExitStack() as stack:
            tail: LogTail | None = None
            closed_normally = opened_after_end = ended_while_open = False
            ended_at = opened_at = marker_at = 0.0
            next_poll = next_open = 0.0
            finishing = False  # ended, marker relayed, stream open: done once the stream is quiet
            gave = False  # the open stream delivered text this follower did not hold
            tried_at, held_at_try = 0.0, -1  # the last bounded read after the end, and what was held then
            while True:
                now = time.monotonic()
                if tail is None or now >= next_poll:
                    fast = marker_at and now - marker_at < self.MARKER_FAST_S
                    next_poll = now + (min(self.poll, self.MARKER_POLL_S) if fast else self.poll)
                    job = await self._get()
                    if job is not None:
                        self.job = job
                        if job.is_terminal:
                            ended_at = ended_at or time.monotonic()
                            ended_while_open = ended_while_open or tail is not None
                        yield job
                    ended = self.job is not None and self.job.is_terminal
                    if tail is None and ended and closed_normally and (
                            opened_after_end or ended_while_open or self.lines.markers):
                        return
                    if self.polling:
                        return
                    waiting = self.job is None or self.job.status == JobStatus.PENDING
                    if tail is None and not waiting and time.monotonic() >= next_open:
                        next_open = time.monotonic() + self.poll
                        tail = await self._open(stack)
                        if tail is not None:
                            opened_after_end, opened_at = ended, time.monotonic()
                            closed_normally = ended_while_open = gave = False
                        elif self.polling:
                            return
                    if tail is None:
                        await asyncio.sleep(max(0.0, next_poll - time.monotonic()))
                        continue
                    if ended and not tried_at and not self.lines.markers:
                        # The end is seen before the open stream brought the marker line: the dashboard sends a
                        # log's new lines a second or more late, while the log is whole once the job ended. One
                        # bounded read of its end now, kept only if it holds the whole log, placed where relaying
                        # stands (else the stream goes on: a cut read is placed by lines that may only look like
                        # the last ones relayed), spares that wait (issue 52).
                        tried_at, held_at_try = time.monotonic(), self.lines.held
                        if await self._read_window(ended=True, only_if_placed=True, whole_only=True):
                            await stack.aclose()
                            return
                    if ended and time.monotonic() - max(ended_at, opened_at, tried_at) > self.END_GRACE_S:
                        # The stream is still open this long after the end: the rest from a bounded read,
                        # when one reaches back to what was relayed; else the stream goes on, reopened
                        # if it made no progress since the last try.
                        tried_at = time.monotonic()
                        if await self._read_window(ended=True, only_if_placed=True):
                            await stack.aclose()
                            return
                        if self.lines.held == held_at_try:
                            await stack.aclose()
                            tail = None
                            continue
                        held_at_try = self.lines.held
                    finishing = ended and bool(self.lines.markers)
                wait = next_poll - time.monotonic()
                try:
                    text = await asyncio.wait_for(tail.next(), max(0.0, min(wait, self.QUIET_S) if finishing else wait))
                except TimeoutError:
                    if finishing:  # the marker was the last line, and nothing more came
                        await stack.aclose()
                        return
                    continue  # time to poll the status
                except RayUnreachableError as exc:
                    await stack.aclose()
                    tail, closed_normally = None, False
                    self._stream_failed(exc, gave)
                    if self.polling:
                        return
                    continue
                if text is None:  # a normal close: at the job's end, or early; the status tells
                    await stack.aclose()
                    tail, closed_normally, next_poll = None, True, 0.0
                    if not gave and not (self.job is not None and self.job.is_terminal):
                        self._stream_failed(RayUnreachableError("closed at once, with nothing"), gave)
                    continue
                held = self.lines.held
                self.lines.chunk(text)
                if self.lines.held > held:
                    gave, self._failed_streams, self._stream_trouble = True, 0, False
                if not marker_at and self.lines.markers:
                    marker_at = time.monotonic()
                    next_poll = min(next_poll, marker_at + self.MARKER_POLL_S)

    async def _polling(self) -> AsyncIterator[JobDetails]:
        """Follow without a stream: each poll reads the status, then the log's last lines (a bounded read)."""
        failed_at_end = 0
        while True:
            job = await self._get()
            if job is not None:
                self.job = job
                yield job
            if self.job is not None and self.job.status != JobStatus.PENDING:
                ended = self.job.is_terminal
                if await self._read_window(ended=ended) and ended:
                    return
                if ended:
                    failed_at_end += 1
                    if failed_at_end >= self.STREAM_ATTEMPTS:
                        self.warn(f"could not read the end of Ray job {self.sid}'s log; "
                                  f"see it with `ray job logs {self.sid}`")
                        return
            await asyncio.sleep(self.poll)

    async def _get(self) -> JobDetails | None:
        """The job's status; None while the dashboard does not answer (within the grace)."""
        try:
            job = await asyncio.wait_for(self.client.get(self.sid), self.call_timeout)
        except (RayUnreachableError, TimeoutError) as exc:
            cause = str(exc) or type(exc).__name__
            now = time.monotonic()
            self._unreachable_since = self._unreachable_since or now
            if now - self._unreachable_since > self.unreachable_grace:
                raise RayUnreachableError(
                    f"lost the Ray dashboard for over {self.unreachable_grace:.0f} s while following Ray job "
                    f"{self.sid}, which may still be running (stop it with `ray job stop {self.sid}`): {cause}",
                    status_code=getattr(exc, "status_code", None),
                ) from None
            self.warn(f"Ray dashboard not answering ({cause}); still following {self.sid}")
            return None
        self._unreachable_since = None
        self.lines.tag = marker_tag_of(job)  # known before the first stream opens (the job has left PENDING)
        return job

    async def _open(self, stack: contextlib.AsyncExitStack) -> LogTail | None:
        try:
            tail = await asyncio.wait_for(stack.enter_async_context(self.client.tail_logs(self.sid)),
                                          self.call_timeout)
        except (RayJobsError, TimeoutError) as exc:
            # A 404 here is not the job's end: Ray's log route can miss a job its status route
            # already shows (seen right after it starts); the status poll decides whether it is gone.
            # A proxy that does not pass websockets answers 400, 404 or nothing: after a few, poll.
            self._stream_failed(exc, gave=False)
            return None
        self.streams += 1
        self.lines.restart()
        return tail

    def _stream_failed(self, exc: BaseException, gave: bool) -> None:
        # While the status polls fail too, the dashboard is away (not the stream): that does not count.
        away = self._unreachable_since is not None and isinstance(exc, RayUnreachableError | TimeoutError)
        self._failed_streams = 0 if gave else self._failed_streams + (not away)
        if self._failed_streams >= self.STREAM_ATTEMPTS:
            self.polling = True
            self.warn(f"the log stream of Ray job {self.sid} is unavailable ({str(exc) or type(exc).__name__}, "
                      f"{self._failed_streams} times in a row); following its status and the end of its log "
                      f"every {self.poll:g} s instead")
            return
        if not self._stream_trouble:
            self.warn(f"the log stream of Ray job {self.sid} failed ({str(exc) or type(exc).__name__}); "
                      "reopening it at the next poll")
        self._stream_trouble = True

    async def _read_window(self, *, ended: bool, only_if_placed: bool = False, whole_only: bool = False) -> bool:
        """Relay the log's end from bounded reads of its last lines; False if the dashboard did not answer.

        A read that does not reach back to the last line relayed is read again with twice the lines, up
        to `MAX_WINDOW`; past that, the lines between are missing from the task log, and a warning says
        so, unless `only_if_placed` (a stream still delivers them): then nothing is relayed, and False.
        `whole_only`: one read, used only if it holds the whole log (placed by offset, never by lines
        that merely look like the last ones relayed); else nothing is relayed, and False.
        """
        assert self.job is not None
        while True:
            asked = self._window
            try:
                text = await asyncio.wait_for(self.client.log_lines(self.job, asked), self.call_timeout)
            except (RayUnreachableError, TimeoutError) as exc:
                self.warn(f"could not read the end of Ray job {self.sid}'s log ({str(exc) or type(exc).__name__})")
                return False
            except RayJobsError as exc:  # e.g. no log file: a job that ended before its driver started
                if ended and not only_if_placed:
                    self.warn(f"Ray job {self.sid}'s log cannot be read ({exc})")
                    return True
                return False
            self.window_reads += 1
            last_try = asked >= self.MAX_WINDOW
            before = self.lines.handled
            if self.lines.window(text, asked, ended=ended, only_if_placed=only_if_placed or not last_try,
                                 whole_only=whole_only):
                placed = True
            elif whole_only:
                return False
            elif last_try and not only_if_placed:
                placed = False
                self.warn(f"more than {asked} lines of Ray job {self.sid}'s log were written between two "
                          f"reads; some are missing here (see `ray job logs {self.sid}`)")
            elif last_try:
                return False
            else:
                self._window = min(self.MAX_WINDOW, asked * 2)
                continue
            fresh = self.lines.handled - before
            self._window = min(self.MAX_WINDOW, fresh + fresh // 2 + self.MIN_WINDOW) if placed else asked
            return True


async def wait_for_step(
    client: AsyncRayJobsClient,
    sid: str,
    *,
    emit: Callable[[str], None] = print,
    poll: float = 1.0,
    unreachable_grace: float = UNREACHABLE_GRACE_S,
    call_timeout: float = 30.0,
) -> Any:
    """Follow the job to its end, relaying its log; return the step's result or raise its error.

    The job runs on without us: a dashboard outage shorter than `unreachable_grace` is waited
    out; a longer one raises an error that names the job, which may still be running.
    """
    follow = JobFollow(client, sid, LogFollower(emit), poll=poll, call_timeout=call_timeout,
                       unreachable_grace=unreachable_grace, warn=lambda message: emit(f"[rayslice] {message}"))
    async for _ in follow.statuses():
        pass
    return follow.outcome()


def run(
    step: StepSpec | Callable[..., Any],
    *,
    request: TpuSliceRequest | AcceleratorRequest | None = None,
    kwargs: dict[str, Any] | None = None,
    address: str | None = None,
    token: str | None = None,
    emit: Callable[[str], None] = print,
    **spec_fields: Any,
) -> Any:
    """Run one step on the cluster and return its result, blocking: `run_step_job` for scripts and notebooks.

    `step` is a `StepSpec`, or a function shipped by value with `request` and `kwargs` (and any other
    `StepSpec` field, e.g. `capacity_timeout=`). `address` is the Ray dashboard URL, by default
    `$RAYSLICE_DASHBOARD_URL` (what `rayslice local env` exports); `token` likewise `$RAYSLICE_RAY_TOKEN`.
    Inside a running event loop (a notebook cell is not one), await `run_step_job` instead.
    """
    address = address or os.environ.get("RAYSLICE_DASHBOARD_URL")
    if not address:
        raise InvalidRequestError("run() needs the Ray dashboard: pass address='http://head:8265' or set "
                                  "RAYSLICE_DASHBOARD_URL (`eval \"$(rayslice local env)\"` sets it locally)")
    if isinstance(step, StepSpec):
        if request is not None or kwargs or spec_fields:
            raise InvalidRequestError("run(spec) takes the StepSpec as it is: give request/kwargs only with a function")
        spec = step
    else:
        if request is None:
            raise InvalidRequestError("run(fn) needs request=, e.g. TpuSliceRequest(tpu='v6e-16') or "
                                      "AcceleratorRequest(resource='GPU', count=0.25)")
        spec = StepSpec.for_function(step, request=request, kwargs=kwargs or {}, **spec_fields)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_step_job(address, spec, token=token or os.environ.get("RAYSLICE_RAY_TOKEN"),
                                        emit=emit))
    raise InvalidRequestError("run() blocks and cannot be called inside a running event loop: await run_step_job()")


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
