"""One step, several Ray clusters: submit it to every cluster of a set at once, follow them all, keep one.

Each cluster's job waits in that cluster's admission queue, at the same arrival; the first cluster to
admit it claims it (`rayslice.core.cluster_claim`, in the step's shared checkpoint folder) before any
host starts, and the others stand by out of their queues. After a suspension (a notice, a lost slice)
the holder releases the claim and the step waits in every queue again, resuming from its checkpoint on
whichever cluster admits it next. The step's outcome is that of the job that ran it; a job that stood
by ends with `RanElsewhereError`, which is only a line in the log here.

A cluster that cannot be reached, that refuses the request (no such slice type, never enough), or whose
submission fails, is skipped with a line that says why; the step goes on with the rest, and fails only
when no cluster is left.

Which cluster runs the step is told as it becomes known (`on_cluster`): every member has a job of the
step's one submission id, so what names "the" job (the task's "Ray job" link, the task's XCom) must name
its cluster too. The claims folder says who holds the step (read every `WATCH_S`, as the standbys read it);
a failover to another cluster is told again, and the cluster that ran it is told last.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rayslice.client.job_details import JobDetails, JobStatus
from rayslice.client.jobs_client import AsyncRayJobsClient
from rayslice.client.submission import submission_id, submit_step, wait_for_step
from rayslice.core.cluster_claim import Claims, ClaimState, ClusterSet, check_shared_root
from rayslice.core.context import checkpoint_dir_for
from rayslice.core.exceptions import (
    InvalidRequestError,
    RanElsewhereError,
    RayJobsError,
    UnsatisfiableRequestError,
)
from rayslice.core.step import Launcher, StepSpec

#: Errors that say a cluster can never run this request: skip it, go on with the rest.
REFUSALS = (UnsatisfiableRequestError,)
#: How often a job that failed while the claims could not be read is asked about again (did it hold the step?).
RECHECK_S = 5.0
#: Reads of the claims are tried this many times (0.5, 1, 2 s apart) through a storage outage.
READ_TRIES = 4
#: How long the standbys get to end by themselves once the step ended on one cluster (they look every second).
STANDBYS_END_S = 15.0
#: How often the submitter reads the claims to tell which cluster holds the step (`on_cluster`).
WATCH_S = 2.0


@dataclass(frozen=True)
class Member:
    """One cluster of the set: its name (in the task log and the claims) and a Jobs client for it."""

    name: str
    client: AsyncRayJobsClient
    launcher: Launcher = "shipped"  # its connection's: whether the job ships rayslice's cluster side


def prefixed(emit: Callable[[str], None], name: str) -> Callable[[str], None]:
    return lambda line: emit(f"[{name}] {line}")


def spec_for_set(spec: StepSpec, set_name: str, members: Sequence[str], *, shared_root: bool = False) -> StepSpec:
    """The step with its set (no member yet) and a submission id; refuses a checkpoint root one machine holds."""
    if not shared_root:
        check_shared_root(spec.checkpoint_root, f"the step on cluster set {set_name!r}")
    elif not spec.checkpoint_root:
        check_shared_root(None, f"the step on cluster set {set_name!r}")
    owner = spec.owner
    if not owner.submission_id:
        owner = owner.model_copy(update={"submission_id": submission_id(owner)})
    clusters = ClusterSet(name=set_name, members=tuple(members), arrival=time.time())
    return spec.model_copy(update={"cluster_set": clusters, "owner": owner})


async def run_on_set(spec: StepSpec, members: Sequence[Member], *, emit: Callable[[str], None] = print,
                     on_cluster: Callable[[str], None] | None = None) -> Any:
    """Run `spec` (from `spec_for_set`) on whichever cluster of `members` admits it first; its result or error.

    `on_cluster(name)` is called when a cluster claims the step, again when another one takes it over (a
    resume after a suspension), and with the cluster that ran it once the outcome is known (each change once).
    A callback that raises is a line in the log, never the step's failure.
    """
    clusters = spec.cluster_set
    if clusters is None:
        raise InvalidRequestError("run_on_set needs a step made by spec_for_set (it names no cluster set)")
    async def submit(member: Member) -> str | None:
        """Reach the member and submit its job; None (and a line saying why) when it is skipped."""
        try:
            await member.client.version()
        except RayJobsError as exc:
            emit(f"[rayslice] cluster {member.name} skipped: unreachable ({exc})")
            return None
        mine = spec.model_copy(update={"cluster_set": clusters.model_copy(update={"member": member.name}),
                                       "launcher": member.launcher})
        for attempt in (1, 2):
            try:
                return await submit_step(member.client, mine, emit=prefixed(emit, member.name))
            except RayJobsError as exc:  # the answer may be what was lost: submitting again by id reattaches
                if attempt == 1:
                    emit(f"[rayslice] cluster {member.name}: the submission failed ({exc}); trying once more (a job "
                         "it made after all is reattached, not made twice)")
                    continue
                emit(f"[rayslice] cluster {member.name} skipped: the submission failed ({exc})")
            except Exception as exc:  # any other failure is this member's: the others' jobs are followed
                emit(f"[rayslice] cluster {member.name} skipped: the submission failed ({type(exc).__name__}: {exc})")
            return None
        return None

    # At once: a member later in the list must not start later for being later (the first admission wins).
    submitted = await asyncio.gather(*(submit(member) for member in members))
    jobs = {member.name: sid for member, sid in zip(members, submitted, strict=True) if sid is not None}
    if not jobs:
        raise UnsatisfiableRequestError(
            f"no cluster of set {clusters.name!r} ({', '.join(clusters.members)}) could take the step: every one was "
            "skipped (the lines above say why)")
    by_name = {m.name: m for m in members}
    told: list[str] = []

    def tell(name: str | None) -> None:
        if on_cluster is None or not name or name not in jobs or (told and told[-1] == name):
            return
        told.append(name)
        try:
            on_cluster(name)
        except Exception as exc:  # the link or XCom is worth a line, never the step
            emit(f"[rayslice] could not record that cluster {name} runs the step: {type(exc).__name__}: {exc}")

    def settle(name: str) -> None:
        """The outcome's cluster, told last: no read begun before it may name another after it."""
        if watcher is not None:
            watcher.cancel()
        tell(name)

    follows = {asyncio.ensure_future(wait_for_step(by_name[name].client, sid, emit=prefixed(emit, name))): name
               for name, sid in jobs.items()}
    watcher = asyncio.ensure_future(_watch_holder(spec, tell)) if on_cluster is not None else None
    errors: list[tuple[str, BaseException]] = []  # failed jobs that did not hold the step when they failed
    unknown: list[tuple[str, BaseException]] = []  # failed jobs whose holding could not be read (asked again)
    try:
        pending = set(follows)
        while pending:
            done, pending = await asyncio.wait(pending, timeout=RECHECK_S, return_when=asyncio.FIRST_COMPLETED)
            for name, exc in unknown:  # a failed job the claims could not be read for: did it hold the step?
                if await _held_by(spec, name):
                    emit(f"[rayslice] the step ran on cluster {name}, and failed there")
                    settle(name)
                    raise exc
            for task in done:
                name = follows[task]
                try:
                    result = task.result()
                except RanElsewhereError as exc:
                    emit(f"[rayslice] cluster {name} stood by: {exc}")
                    continue
                except REFUSALS as exc:
                    emit(f"[rayslice] cluster {name} skipped: it refused the request ({exc})")
                    continue
                except Exception as exc:  # the step's failure on the cluster that ran it, or a job lost
                    held = await _held_by(spec, name)
                    if held:  # it ran the step (or died holding it): that is the outcome
                        emit(f"[rayslice] the step ran on cluster {name}, and failed there")
                        settle(name)
                        raise
                    (unknown if held is None else errors).append((name, exc))
                    continue
                emit(f"[rayslice] the step ran on cluster {name}")
                settle(name)
                if pending:  # the standbys read the claims' end within a second or two
                    ended, _ = await asyncio.wait(pending, timeout=STANDBYS_END_S)
                    for other in ended:
                        _say_how_it_ended(follows[other], other, emit)
                return result
        failed = unknown + errors
        for name, exc in failed:  # every job ended: the claims say which failure was the step's
            if await _held_by(spec, name):
                emit(f"[rayslice] the step ran on cluster {name}, and failed there")
                settle(name)
                raise exc
        if failed:
            raise failed[0][1]
        raise UnsatisfiableRequestError(
            f"no cluster of set {clusters.name!r} ran the step: every one refused it or stood by (the lines above "
            "say why)")
    finally:
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        leftover = [task for task in follows if not task.done()]
        for task in leftover:
            task.cancel()
        if leftover:
            await asyncio.gather(*leftover, return_exceptions=True)
            for task in leftover:  # cancelled (the caller was, or the standbys outlived their grace): stop them
                name = follows[task]
                try:
                    await by_name[name].client.stop(jobs[name])
                except RayJobsError as exc:
                    emit(f"[rayslice] could not stop Ray job {jobs[name]} on cluster {name}: {exc}")


def _claims_state(spec: StepSpec) -> ClaimState | None:
    """The step's claims now (blocking: run it in a thread); None without a folder."""
    folder = checkpoint_dir_for(spec.checkpoint_root, spec.owner)
    if not folder:
        return None
    return Claims(folder, member="", submission_id=spec.owner.submission_id or "adhoc").state()


def holder_of(state: ClaimState | None) -> str | None:
    """The cluster that ended the step (its `done`), else the one holding the generation in play; None: nobody."""
    if state is None:
        return None
    if state.done is not None:
        return state.done.get("cluster") or None
    name = (state.holder or {}).get("cluster")
    return None if not name or name == "?" else name  # "?": a claim still being written


async def _held_by(spec: StepSpec, name: str) -> bool | None:
    """Whether cluster `name` holds the step's claim now or ended it (its `done`), as the shared folder says.

    A job that failed there is then the step's failure: its driver may have died without writing `done`, and the
    others would stand by for ever. A read is tried again through a storage outage (4 tries); None: still
    unreadable (`run_on_set` asks again every `RECHECK_S` while others still run).
    """
    for attempt in range(READ_TRIES):
        try:
            state = await asyncio.to_thread(_claims_state, spec)
            return holder_of(state) == name
        except Exception:
            if attempt < READ_TRIES - 1:
                await asyncio.sleep(min(4.0, 0.5 * 2 ** attempt))
    return None


async def _watch_holder(spec: StepSpec, tell: Callable[[str | None], None]) -> None:
    """Tell each cluster that claims the step, as the claims folder says, until cancelled. Between two
    generations (released, not yet claimed again) nobody is told: the last holder stands until the next.
    A read that fails is tried again at the next look (the standbys' own reads wait out an outage too)."""
    while True:
        try:
            tell(holder_of(await asyncio.to_thread(_claims_state, spec)))
        except Exception:
            pass
        await asyncio.sleep(WATCH_S)


def _say_how_it_ended(name: str, task: asyncio.Future, emit: Callable[[str], None]) -> None:
    """A member's job that ended after the step's outcome was known: a line, never the step's outcome."""
    if task.cancelled():
        return
    error = task.exception()
    if isinstance(error, RanElsewhereError):
        emit(f"[rayslice] cluster {name} stood by: {error}")
    elif error is not None:
        emit(f"[rayslice] cluster {name} ended with {type(error).__name__}: {error}")



def stood_by(job: JobDetails) -> bool:
    """Whether a member's job ended standing by (another cluster ran the step): its Ray job fails with
    `RanElsewhereError`, which Ray's message for a failed job carries in the log's last lines it quotes."""
    return job.status is JobStatus.FAILED and RanElsewhereError.__name__ in (job.message or "")


def ran_by(jobs: Mapping[str, JobDetails | None], unknown: Sequence[str] = ()) -> str | None:
    """Which member's job of a set's step ran it or runs it, from the members' job records alone (None: they do not
    tell: every job still waits, or more than one is left). For the "Ray job" link before the operator said which.

    `jobs`: each member's record (None: it has no job of that id, e.g. skipped at submission); `unknown`: members
    that could not be asked. The job that succeeded ran it; else, when every member answered, the one job that
    exists and did not stand by (with a member unheard, a waiting standby could look like the only one left).
    """
    succeeded = [name for name, job in jobs.items() if job is not None and job.status is JobStatus.SUCCEEDED]
    if len(succeeded) == 1:
        return succeeded[0]
    if unknown:
        return None
    left = [name for name, job in jobs.items() if job is not None and not stood_by(job)]
    return left[0] if len(left) == 1 else None
