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
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rayslice.client.jobs_client import AsyncRayJobsClient
from rayslice.client.submission import submission_id, submit_step, wait_for_step
from rayslice.core.cluster_claim import Claims, ClusterSet, check_shared_root
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
#: How long the standbys get to end by themselves once the step ended on one cluster (they look every second).
STANDBYS_END_S = 15.0


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


async def run_on_set(spec: StepSpec, members: Sequence[Member], *, emit: Callable[[str], None] = print) -> Any:
    """Run `spec` (from `spec_for_set`) on whichever cluster of `members` admits it first; its result or error."""
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
        try:
            return await submit_step(member.client, mine, emit=prefixed(emit, member.name))
        except RayJobsError as exc:
            emit(f"[rayslice] cluster {member.name} skipped: the submission failed ({exc})")
            return None

    # At once: a member later in the list must not start later for being later (the first admission wins).
    submitted = await asyncio.gather(*(submit(member) for member in members))
    jobs = {member.name: sid for member, sid in zip(members, submitted, strict=True) if sid is not None}
    if not jobs:
        raise UnsatisfiableRequestError(
            f"no cluster of set {clusters.name!r} ({', '.join(clusters.members)}) could take the step: every one was "
            "skipped (the lines above say why)")
    by_name = {m.name: m for m in members}
    follows = {asyncio.ensure_future(wait_for_step(by_name[name].client, sid, emit=prefixed(emit, name))): name
               for name, sid in jobs.items()}
    errors: list[tuple[str, BaseException]] = []
    try:
        pending = set(follows)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
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
                    if await _held_by(spec, name):  # it ran the step (or died holding it): that is the outcome
                        emit(f"[rayslice] the step ran on cluster {name}, and failed there")
                        raise
                    errors.append((name, exc))
                    continue
                emit(f"[rayslice] the step ran on cluster {name}")
                if pending:  # the standbys read the claims' end within a second or two
                    ended, _ = await asyncio.wait(pending, timeout=STANDBYS_END_S)
                    for other in ended:
                        _say_how_it_ended(follows[other], other, emit)
                return result
        if errors:
            raise errors[0][1]
        raise UnsatisfiableRequestError(
            f"no cluster of set {clusters.name!r} ran the step: every one refused it or stood by (the lines above "
            "say why)")
    finally:
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


async def _held_by(spec: StepSpec, name: str) -> bool:
    """Whether cluster `name` holds the step's claim now or ended it (its `done`), as the shared folder says.

    A job that failed there is then the step's failure: its driver may have died without writing `done`, and the
    others would stand by for ever. Storage that cannot be read says no (the job's error waits for the rest).
    """
    folder = checkpoint_dir_for(spec.checkpoint_root, spec.owner)
    if not folder:
        return False
    try:
        state = await asyncio.to_thread(
            Claims(folder, member="", submission_id=spec.owner.submission_id or "adhoc").state)
    except Exception:
        return False
    ended = (state.done or {}).get("cluster")
    return ended == name or (ended is None and (state.holder or {}).get("cluster") == name)


def _say_how_it_ended(name: str, task: asyncio.Future, emit: Callable[[str], None]) -> None:
    """A member's job that ended after the step's outcome was known: a line, never the step's outcome."""
    if task.cancelled():
        return
    error = task.exception()
    if isinstance(error, RanElsewhereError):
        emit(f"[rayslice] cluster {name} stood by: {error}")
    elif error is not None:
        emit(f"[rayslice] cluster {name} ended with {type(error).__name__}: {error}")

