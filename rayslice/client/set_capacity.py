"""Capacity over a cluster set: every member's slices and GPU nodes, and the queue across them, each step once.

A step on a set (`rayslice.client.cluster_set`) is one Ray job per member, all with the same submission id:
it waits in every member's admission queue at once (each lists it as pending demand), then one member runs
it and the others stand by, out of their queues and holding nothing (`rayslice.cluster.set_member`); for a
second or so after the claim a standby may still be listed in its queue. Read member by member, that one
step looks like several competing for capacity. `join` folds them by submission id into one row: the
members whose queue it waits in (and its place in each line), or the member that holds capacity for it and
those where it stands by. A standby holds nothing a snapshot shows, so the members are asked for the job of
that id (`standing_by`, only for steps whose job's metadata names the set).

A member that cannot be read (down, refused, its connection broken) is a line that says why, never the
whole view's failure. Pure reads over HTTP, through the capacity snapshot and the Jobs client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from rayslice.client.capacity import Pending, Snapshot, asnapshot
from rayslice.client.capacity import render as render_one
from rayslice.client.job_records import records_for
from rayslice.client.jobs_client import AsyncRayJobsClient
from rayslice.core.exceptions import RaysliceError

__all__ = ["Across", "MemberCapacity", "SetSnapshot", "Source", "aread", "held_steps", "join", "read", "render",
           "standing_by"]


@dataclass(frozen=True)
class Source:
    """One member as this side reaches it: its dashboard and credentials, or why its connection gave none."""

    name: str
    dashboard_url: str = ""
    token: str | None = field(default=None, repr=False)
    verify: bool | str = True
    headers: dict[str, str] | None = field(default=None, repr=False)
    problem: str = ""  # the member's connection could not be resolved: this, instead of a reading
    launcher: str = "shipped"  # its connection's `launcher` extra (`rayslice queue` ships nothing to "installed")


class MemberCapacity(BaseModel):
    """One member's reading: its snapshot, or why there is none (`error`)."""

    name: str
    snapshot: Snapshot | None = None
    error: str = ""


class Across(BaseModel):
    """One step (or other demand) in the queue across the set, however many members list it."""

    demand: Pending  # as the first member (in the set's order) that lists it sees it
    waits_on: list[str] = []  # the members in whose queue it waits, in the set's order
    places: dict[str, int] = {}  # its place in line on each of those (where the member numbers it)
    runs_on: str | None = None  # the member that holds capacity for it (runs it, or is reserving for it)
    stands_by: list[str] = []  # members whose job of it waits, out of their queue, while `runs_on` has it


class SetSnapshot(BaseModel):
    name: str  # the set's connection id
    members: list[MemberCapacity]
    queue: list[Across]
    taken_at: datetime


def held_steps(members: Sequence[MemberCapacity]) -> dict[str, tuple[str, str]]:
    """submission id -> (the first member holding capacity for it, its set per its job's metadata)."""
    held: dict[str, tuple[str, str]] = {}
    for member in members:
        snap = member.snapshot
        if snap is None:
            continue
        holders = [s.holder for s in snap.slices] + [h.holder for s in snap.slices for h in s.hosts]
        holders += [share.holder for n in snap.gpu_nodes for share in n.shares]
        for holder in holders:
            if holder is not None and holder.submission_id:
                held.setdefault(holder.submission_id, (member.name, holder.cluster_set))
    return held


def join(members: Sequence[MemberCapacity], standing: dict[str, list[str]] | None = None) -> list[Across]:
    """The queue across `members` (in the set's order): every pending demand once per submission id.

    `standing`: submission id -> the members whose job of it stands by (`standing_by`). A step held on one
    member and still listed in another's queue (its launcher there leaves within a second) stands by there.
    Waiting rows first, longest wait first; then the steps that run on one member while others stand by.
    """
    held = held_steps(members)
    rows: dict[str, Across] = {}
    for member in members:
        for i, p in enumerate(member.snapshot.pending if member.snapshot else []):
            sid = p.holder.submission_id if p.holder else ""
            key = sid or f"{member.name}#{i}"  # demand nobody can trace across members stays its member's
            row = rows.get(key)
            if row is None:
                row = rows[key] = Across(demand=p, runs_on=held.get(sid, (None, ""))[0] if sid else None)
            if row.runs_on == member.name:
                continue  # its own reservation in progress where it runs
            if row.runs_on is not None:
                if member.name not in row.stands_by:
                    row.stands_by.append(member.name)
                continue
            if member.name not in row.waits_on:
                row.waits_on.append(member.name)
            if p.place:
                row.places[member.name] = p.place
            if (p.waiting_s or 0) > (row.demand.waiting_s or 0):  # the longest wait: its arrival is one for all
                row.demand = row.demand.model_copy(update={"waiting_s": p.waiting_s, "since": p.since})
    for sid, names in (standing or {}).items():
        where = held.get(sid)
        if where is None:
            continue
        row = rows.get(sid)
        if row is None:
            holder = _holder_of(members, where[0], sid)
            row = rows[sid] = Across(demand=Pending(kind="queue", request=holder.request if holder else "",
                                                    resources={}, holder=holder), runs_on=where[0])
        row.stands_by = [m.name for m in members if m.name in {*row.stands_by, *names} and m.name != where[0]]
    waiting = sorted((r for r in rows.values() if r.runs_on is None),
                     key=lambda r: (r.demand.starting, -(r.demand.waiting_s or 0)))
    return waiting + [r for r in rows.values() if r.runs_on is not None]


def _holder_of(members: Sequence[MemberCapacity], name: str, sid: str) -> Any:
    for member in members:
        if member.name == name and member.snapshot:
            snap = member.snapshot
            holders = [s.holder for s in snap.slices] + [h.holder for s in snap.slices for h in s.hosts]
            holders += [share.holder for n in snap.gpu_nodes for share in n.shares]
            return next((h for h in holders if h is not None and h.submission_id == sid), None)
    return None


async def standing_by(set_name: str, members: Sequence[MemberCapacity], sources: Sequence[Source], *,
                      timeout: float = 10.0) -> dict[str, list[str]]:
    """For each step of this set held on one member: the other members whose job of it is still running there
    (standing by: a standby holds nothing a snapshot shows). Best effort: a member that fails this says nothing."""
    held = {sid: name for sid, (name, of_set) in held_steps(members).items() if of_set == set_name}
    if not held:
        return {}
    readable = {m.name for m in members if m.snapshot is not None}

    async def ask(source: Source) -> tuple[str, list[dict[str, Any]]]:
        ids = [sid for sid, name in held.items() if name != source.name]
        if not ids or source.name not in readable:
            return source.name, []
        try:
            async with AsyncRayJobsClient(source.dashboard_url, token=source.token, timeout=timeout,
                                          verify=source.verify, headers=source.headers) as client:
                return source.name, await records_for(client.address).afind(client, ids)
        except RaysliceError:
            return source.name, []

    found: dict[str, list[str]] = {}
    for name, jobs in await asyncio.gather(*(ask(s) for s in sources)):
        for job in jobs:
            if job.get("status") in ("PENDING", "RUNNING") and (sid := job.get("submission_id")) in held:
                found.setdefault(sid, []).append(name)
    return found


async def aread(set_name: str, sources: Sequence[Source], *, timeout: float = 10.0,
                reader: Callable[[Source], Awaitable[Snapshot]] | None = None) -> SetSnapshot:
    """Every member's snapshot at once (`reader`: how one member is read, e.g. through a cache), and the queue
    across them. A member whose connection or dashboard fails is kept with why."""

    async def one(source: Source) -> MemberCapacity:
        if source.problem:
            return MemberCapacity(name=source.name, error=source.problem)
        try:
            if reader is not None:
                snap = await reader(source)
            else:
                snap = await asnapshot(source.dashboard_url, token=source.token, timeout=timeout,
                                       verify=source.verify, headers=source.headers)
        except RaysliceError as exc:
            return MemberCapacity(name=source.name, error=str(exc))
        return MemberCapacity(name=source.name, snapshot=snap)

    members = list(await asyncio.gather(*(one(s) for s in sources)))
    standing = await standing_by(set_name, members, sources, timeout=timeout)
    return SetSnapshot(name=set_name, members=members, queue=join(members, standing),
                       taken_at=datetime.fromtimestamp(time.time(), UTC))


def read(set_name: str, sources: Sequence[Source], *, timeout: float = 10.0) -> SetSnapshot:
    """`aread` for the CLI (blocking)."""
    return asyncio.run(aread(set_name, sources, timeout=timeout))


# --------------------------------------------------------------------------- rendering


def where(row: Across) -> str:
    """ "waits on set-a (1st in line), set-b (2nd in line)" or "runs on set-b; stands by on set-a"."""
    from rayslice.core.queue import ordinal

    if row.runs_on is not None:
        return f"runs on {row.runs_on}" + (f"; stands by on {', '.join(row.stands_by)}" if row.stands_by else "")
    return "waits on " + ", ".join(f"{name} ({ordinal(row.places[name])} in line)" if name in row.places else name
                                   for name in row.waits_on)


def render(found: SetSnapshot) -> Any:
    """Rich output for `rayslice capacity --conn-id <set>`: each member under its name, then the queue across."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from rayslice.client.capacity import _duration, _queue_place

    parts: list[Any] = [Text(f"cluster set {found.name}: {', '.join(m.name for m in found.members)}", style="bold")]
    for member in found.members:
        parts.append(Text(f"\n== cluster {member.name} ==", style="bold"))
        if member.snapshot is None:
            parts.append(Text(f"cluster {member.name}: unreachable ({member.error})", style="red"))
            continue
        parts.append(render_one(member.snapshot, pending=False))
    table = Table(title=f"Queue across set {found.name}", title_justify="left")
    for column in ("request", "holder", "where", "waiting"):
        table.add_column(column, overflow="fold")
    for row in found.queue:
        p = row.demand
        wait = "starting (capacity is free)" if p.starting else _duration(p.waiting_s)
        if row.runs_on is None and (more := _queue_place(p.model_copy(update={"place": None}))):
            wait += f" ({more})"
        table.add_row(p.request, p.holder.label if p.holder else "", where(row),
                      "" if row.runs_on is not None else wait)
    parts.append(Text(""))
    parts.append(table if found.queue else Text(f"Nothing waits on set {found.name}.", style="dim"))
    return Group(*parts)
