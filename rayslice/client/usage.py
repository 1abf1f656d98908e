"""Who used which accelerators over the last hours: one bar per step per slice or GPU node, and the bill.

Read from what the Ray cluster already records, over the dashboard's HTTP API (no new store,
no `ray` import): the Jobs API (`/api/jobs/`: each rayslice job's metadata names its Airflow
task; start and end times) and the dashboard's actor table (`/logical/actors`: every host
process a step ran, alive or ended, with its node, the chips or GPU share it asked for, and its
start and end in ms). A step's host processes are named `rayslice:<submission id>/<slice>/host<i>`
(TPU) or `rayslice:<submission id>/GPU`, so each one traces to its job and its lane.

A bar spans a step's host processes on one lane: from the first one's start to the last one's
end (still running: until now). Accelerator-hours are summed per host process over its overlap
with the window: TPU chip-hours = chips x hours, GPU-hours = GPU share x hours. The time a step
spent waiting for capacity (job start to its reservation) is shown, never billed.

A host process starts seconds after its attempt's capacity is reserved (the worker process, the
runtime env) and ends a little before the release: the chips are held all along. An ended step's
goodput record names each attempt's hold (reserved to released, `Account.held`), so each of its
host processes is billed over its attempt's whole hold: the bill and the goodput's held chip-time
agree. A running step (no record yet), or one whose record is unreadable, is billed from its host
processes' lifetimes.

A cluster set (a `ray` connection that lists others) is read member by member and joined (`merge`,
`usage_of_set`): every bar and lane says its cluster, and a step's figures add up its members' records.
Only a member whose job held capacity has any: a job that stood by (another cluster ran the step; its Ray
job ends FAILED with `RanElsewhereError`) started no host process, so it has no bar, no chip-hours, no
attempt and no figures, and is no failure here; a step that moved after a suspension has an attempt on
each cluster it held capacity on, and counts once.

How far back: as far as Ray keeps ended actors, the `maximum_gcs_destroyed_actor_cached_count`
most recent (100,000 by default in Ray 2.60: 25,000 four-host steps), and never before the head
node's start (a restarted head without GCS fault tolerance forgets every job and actor).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Literal, get_args

from pydantic import BaseModel, computed_field, model_validator

from rayslice.client import step_goodput
from rayslice.client.actor_table import _ACTORS, _ms, aread_window
from rayslice.client.capacity import (
    POD_TYPE_LABEL,
    PREFIX,
    SLICE_LABEL,
    _base,
    _client,
)
from rayslice.client.job_records import records_for
from rayslice.client.jobs_client import AsyncRayJobsClient, RayJobsClient
from rayslice.core.accelerators import ResourceName
from rayslice.core.goodput import CATEGORIES, Account
from rayslice.core.step import TaskRef

__all__ = ["Bar", "Lane", "Usage", "UsageRow", "ausage", "merge", "parse", "select", "totals", "usage",
           "usage_of_set"]

WINDOWS_H = (1, 3, 6, 12, 24, 72)
DEFAULT_WINDOW_H = 6
_NODES = ("/api/v0/nodes", {"detail": "1", "limit": "10000"})  # dead nodes too: their slices had steps
#: Every accelerator a step may hold, in the order lanes and table columns show them.
ACCELERATORS: tuple[str, ...] = ("TPU", "GPU", *(r for r in get_args(ResourceName) if r not in ("TPU", "GPU")))


class Lane(BaseModel):
    """A TPU slice (by name) or an accelerator node (by node id): one row of the timeline."""

    key: str
    kind: Literal["tpu", "gpu", "accelerator"]  # a slice, a GPU node, a node of another accelerator
    title: str
    detail: str = ""
    cluster: str = ""  # in a cluster set's view: the member it belongs to ("" when one cluster is read)


class Bar(TaskRef):
    """One step on one lane. `amount` is how many `resource` units (chips, GPU share, NPUs ...) it held;
    `hours` its units x hours in the window."""

    lane: str
    kind: Literal["tpu", "gpu", "accelerator"]
    resource: str = ""  # the Ray resource: "TPU" on a slice's lane, "GPU" on a GPU node's unless given
    submission_id: str
    job_id: str | None = None
    job_status: str | None = None
    request: str = ""
    start: datetime
    end: datetime | None = None  # None: still holding it
    amount: float
    hours: float
    waited_s: float | None = None
    team: str = ""  # the team the step counted against (its job's metadata), "" for none
    hidden: bool = False
    cluster: str = ""  # in a cluster set's view: the member that held it ("" when one cluster is read)

    @model_validator(mode="after")
    def _default_resource(self) -> Bar:
        self.resource = self.resource or ("TPU" if self.kind == "tpu" else "GPU")
        return self


class UsageRow(BaseModel):
    """Steps and accelerator-hours (units x hours) per Ray resource, e.g. {"TPU": 16.0, "NPU": 2.0}."""

    dag_id: str
    task_id: str | None = None
    steps: int
    hours: dict[str, float] = {}
    hidden: bool = False
    #: Goodput figures of the row's ended steps that have them (`measured` of `steps`): chip-hours per
    #: category (rayslice.core.goodput), and productive over held.
    measured: int = 0
    chip_h: dict[str, float] = {}
    held_chip_h: float | None = None  # the measured steps' chip-hours held, by their timelines (reserved to released)
    goodput: float | None = None
    #: In a cluster set's view: attempts that held capacity, per member cluster (`Usage.attempts`; a step without
    #: figures, e.g. still running, counts one per cluster it has bars on). Empty when one cluster is read.
    clusters: dict[str, int] = {}

    @computed_field
    @property
    def tpu_chip_hours(self) -> float:
        return self.hours.get("TPU", 0.0)

    @computed_field
    @property
    def gpu_hours(self) -> float:
        return self.hours.get("GPU", 0.0)


class Usage(BaseModel):
    since: datetime
    until: datetime
    hours: float
    lanes: list[Lane]
    bars: list[Bar]
    oldest: datetime | None = None  # the first start of a step's host process Ray still lists
    #: Submission id -> the ended step's goodput figures (`Account.to_json`), where its job log has them.
    goodput: dict[str, dict[str, Any]] = {}
    #: A cluster set's view: submission id -> {member: attempts that held capacity there}, from the goodput records.
    attempts: dict[str, dict[str, int]] = {}
    #: A cluster set's view: the members that could not be read, and why (the rest is shown).
    unread: dict[str, str] = {}


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def _amount(resources: dict[str, Any], name: str) -> float:
    """Chips or GPU share an actor asked for; inside a placement group Ray renames `TPU` to `TPU_group_…`."""
    return max((float(v) for k, v in (resources or {}).items() if _base(k) == name and v), default=0.0)


def parse(nodes_body: Any, actors_body: Any, jobs: Any, *, now: float, hours: float,
          goodput: dict[str, dict[str, Any]] | None = None) -> Usage:
    """Bars and lanes for the window `[now - hours, now]` from the dashboard's answers (no I/O)."""
    since = now - hours * 3600
    nodes = (nodes_body or {}).get("data", {}).get("result", {}).get("result") or [] if isinstance(
        nodes_body, dict) else []
    actors = ((actors_body or {}).get("data", {}).get("actors") or {}) if isinstance(actors_body, dict) else {}
    jobs = [j for j in (jobs if isinstance(jobs, list) else [])
            if (j.get("metadata") or {}).get("rayslice") == "1" and j.get("submission_id")]
    by_sid = {j["submission_id"]: j for j in jobs}

    lanes: dict[str, Lane] = {}
    slice_of: dict[str, str] = {}  # node id -> its slice (dead nodes too: a fraction ran there)
    node_lanes: dict[str, Lane] = {}
    for node in sorted(nodes, key=lambda n: n.get("node_id", "")):
        labels, total = node.get("labels") or {}, node.get("resources_total") or {}
        if labels.get(SLICE_LABEL) and total.get("TPU"):
            slice_of[node.get("node_id", "")] = name = labels[SLICE_LABEL]
            if node.get("state") == "ALIVE":
                lanes.setdefault(name, Lane(key=name, kind="tpu", title=name, detail=labels.get(POD_TYPE_LABEL, "")))
        elif any(total.get(r) for r in ACCELERATORS if r != "TPU"):
            node_lanes[node["node_id"]] = lane = _node_lane(node["node_id"], total)
            if node.get("state") == "ALIVE":
                lanes.setdefault(lane.key, lane)

    # (submission id, lane, resource) -> the host processes of that step there: (start, end or None, amount)
    spans: dict[tuple[str, str, str], list[tuple[float, float | None, float]]] = {}
    holds = {sid: Account.from_json(figures).held for sid, figures in (goodput or {}).items()}
    oldest: float | None = None
    for actor in actors.values():
        name = (actor or {}).get("name") or ""
        start = _ms(actor.get("startTime"))
        if not name.startswith(PREFIX) or start is None:
            continue  # not a step's host process, or never started (it waited, then gave up)
        oldest = start if oldest is None else min(oldest, start)
        sid, _, rest = name[len(PREFIX):].partition("/")
        end = _ms(actor.get("endTime")) if actor.get("state") == "DEAD" else None
        start, end = _held(start, end, holds.get(sid), _lived(by_sid.get(sid), now))
        if end is not None and end < since:
            continue
        held = [(r, a) for r in ACCELERATORS if (a := _amount(actor.get("requiredResources") or {}, r))]
        if not held:
            continue
        resource, amount = held[0]
        node = (actor.get("address") or {}).get("nodeId") or ""
        if resource == "TPU" and ("/" in rest or node in slice_of):
            key = rest.split("/", 1)[0] if "/" in rest else slice_of[node]  # <slice>/host<i>, or a fraction
            lanes.setdefault(key, Lane(key=key, kind="tpu", title=key))
        else:
            lane = node_lanes.get(node) or _node_lane(node or f"unknown {resource} node", {resource: 0})
            key = lane.key
            lanes.setdefault(key, lane)
        spans.setdefault((sid, key, resource), []).append((start, end, amount))

    bars = []
    for (sid, key, resource), procs in spans.items():
        job = by_sid.get(sid) or {}
        meta = job.get("metadata") or {}
        first = min(s for s, _, _ in procs)
        ends = [e for _, e, _ in procs]
        end = None if any(e is None for e in ends) else max(e for e in ends if e is not None)
        used = sum(a * max(0.0, min(e if e is not None else now, now) - max(s, since)) for s, e, a in procs) / 3600
        job_start = _ms(job.get("start_time"))
        bars.append(Bar(
            lane=key, kind=lanes[key].kind, resource=resource, submission_id=sid, job_id=job.get("job_id"),
            job_status=job.get("status"),
            **TaskRef.fields_from(meta), request=meta.get("request", ""), start=_at(first),
            end=_at(end) if end is not None else None,
            amount=round(_concurrent(procs), 6), hours=round(used, 6), team=meta.get("team", ""),
            waited_s=round(max(0.0, first - job_start), 1) if job_start else None))
    bars.sort(key=lambda b: (b.start, b.lane))
    ordered = sorted(lanes.values(), key=lambda lane: (lane.kind != "tpu", lane.title))
    return Usage(since=_at(since), until=_at(now), hours=hours, lanes=ordered, bars=bars,
                 oldest=_at(oldest) if oldest is not None else None, goodput=dict(goodput or {}))


#: A host process starts within its attempt's hold; clocks of two machines may disagree by this much.
CLOCK_SLACK_S = 5.0


def _lived(job: dict[str, Any] | None, now: float) -> tuple[float, float] | None:
    """When the step's Ray job started and ended (still running: now), from Ray's own job record; None if unknown."""
    start = _ms((job or {}).get("start_time"))
    if start is None:
        return None
    end = _ms(job.get("end_time"))
    return start, end if end is not None else now


def _held(start: float, end: float | None, holds: list[list[float]] | None,
          lived: tuple[float, float] | None) -> tuple[float, float | None]:
    """A host process's billed span: its attempt's whole hold (reserved to released) where the record names it.

    The attempt is the one whose hold contains the process's start, within the clock slack; where two
    do (a suspension as the hosts came up, the next attempt reserved a second later), the one nearest
    to it, and never one that began after the process ended (`_distance`).
    The record is read from the job's log, where the step's own program prints too, so a hold only
    widens the process's span within its job's life as Ray recorded it (`lived`): no job known, no widening.
    """
    if end is None or lived is None:
        return start, end
    found = [(a, b) for a, b, _ in holds or ()
             if a - CLOCK_SLACK_S <= start <= b + CLOCK_SLACK_S and a - CLOCK_SLACK_S <= end]
    if not found:
        return start, end
    reserved, released = min(found, key=lambda hold: _distance(start, end, hold))
    first, last = lived[0] - CLOCK_SLACK_S, lived[1] + CLOCK_SLACK_S
    return min(start, max(reserved, first)), max(end, min(released, last))


def _distance(start: float, end: float, hold: tuple[float, float]) -> tuple[float, float]:
    """How far a host process's life is from a hold: outside it first (0 when the hold holds it), then its start's."""
    reserved, released = hold
    return max(0.0, reserved - start) + max(0.0, end - released), abs(start - reserved)


def step_ids(actors_body: Any, *, now: float, hours: float) -> set[str]:
    """The submission ids of the steps whose host processes overlap the window: the jobs `parse` needs."""
    since = now - hours * 3600
    actors = ((actors_body or {}).get("data", {}).get("actors") or {}) if isinstance(actors_body, dict) else {}
    out = set()
    for actor in actors.values():
        name = (actor or {}).get("name") or ""
        if name.startswith(PREFIX) and _ms(actor.get("startTime")) is not None:
            end = _ms(actor.get("endTime")) if actor.get("state") == "DEAD" else None
            if end is None or end >= since:
                out.add(name[len(PREFIX):].split("/", 1)[0])
    return out


def _node_lane(node_id: str, total: dict[str, Any]) -> Lane:
    """A node's lane, named after its first accelerator ("GPU node 1a2b..."), its accelerators as detail."""
    kinds = [r for r in ACCELERATORS if r != "TPU" and r in total] or ["TPU"]  # TPU: a host of no slice
    detail = ", ".join(f"{float(total[r]):g} {r}{'s' if r.isupper() else ''}" for r in kinds if total[r])
    return Lane(key=node_id, kind="gpu" if kinds[0] == "GPU" else "accelerator",
                title=f"{kinds[0]} node {node_id[:12]}", detail=detail)


def _concurrent(procs: list[tuple[float, float | None, float]]) -> float:
    """The most chips (or GPU share) the step held on the lane at once: its gang, not its retries summed."""
    events = sorted([(s, a) for s, _, a in procs] + [(e, -a) for _, e, a in procs if e is not None],
                    key=lambda ev: (ev[0], ev[1]))
    held = peak = 0.0
    for _, delta in events:
        held += delta
        peak = max(peak, held)
    return peak


def merge(by_cluster: Mapping[str, Usage], unread: Mapping[str, str] | None = None) -> Usage:
    """A cluster set's members' readings as one: each lane and bar marked with its cluster (lane keys
    `<cluster>:<lane>`, since two clusters may name a slice alike), a step's figures summed over its members'
    records, and `attempts` saying how many of its attempts held capacity on which cluster.

    A member whose job of a step stood by has no bar and no figures for it (nothing was held there): it adds
    nothing, so the step counts once, with the attempts, chip-hours and goodput of the clusters that ran it.
    """
    from rayslice.core.goodput import Account

    lanes: list[Lane] = []
    bars: list[Bar] = []
    figures: dict[str, Account] = {}
    attempts: dict[str, dict[str, int]] = {}
    for name, found in by_cluster.items():
        lanes += [lane.model_copy(update={"key": f"{name}:{lane.key}", "title": f"{name}: {lane.title}",
                                          "cluster": name}) for lane in found.lanes]
        bars += [bar.model_copy(update={"lane": f"{name}:{bar.lane}", "cluster": name}) for bar in found.bars]
        for sid, data in found.goodput.items():
            account = Account.from_json(data)
            figures[sid] = figures[sid].add(account) if sid in figures else account
            if account.attempts:
                attempts.setdefault(sid, {})[name] = attempts.get(sid, {}).get(name, 0) + account.attempts
    readings = list(by_cluster.values())
    now = max((f.until for f in readings), default=datetime.now(UTC))
    hours = max((f.hours for f in readings), default=DEFAULT_WINDOW_H)
    oldest = min((f.oldest for f in readings if f.oldest is not None), default=None)
    bars.sort(key=lambda b: (b.start, b.lane))
    lanes.sort(key=lambda lane: (lane.kind != "tpu", lane.title))
    return Usage(since=min((f.since for f in readings), default=now), until=now, hours=hours, lanes=lanes, bars=bars,
                 oldest=oldest, goodput={sid: a.to_json() for sid, a in figures.items()}, attempts=attempts,
                 unread=dict(unread or {}))


def usage_of_set(members: Mapping[str, Callable[[], Usage]]) -> Usage:
    """Each member's usage (`read()` per member, e.g. `usage` of its dashboard) joined by `merge`. A member that
    cannot be read is left out and named in `unread`; when none can be, the first member's error is raised."""
    from rayslice.core.exceptions import RaysliceError

    found: dict[str, Usage] = {}
    unread: dict[str, str] = {}
    first: RaysliceError | None = None
    for name, read in members.items():
        try:
            found[name] = read()
        except RaysliceError as exc:
            unread[name] = str(exc)
            first = first or exc
    if not found and first is not None:
        raise first
    return merge(found, unread)


def totals(bars: list[Bar], goodput: dict[str, dict[str, Any]] | None = None,
           attempts: dict[str, dict[str, int]] | None = None) -> tuple[list[UsageRow], list[UsageRow]]:
    """Accelerator-hours per DAG and per (DAG, task) over the window, largest first; hidden DAGs make one row.

    With `goodput` (Usage.goodput), each row also sums the figures of its steps that have them; with
    `attempts` (Usage.attempts, a cluster set's view), each row says how many attempts held capacity where.
    """
    def add(rows: dict, key: tuple, bar: Bar) -> None:
        hours, steps = rows.setdefault(key, ({}, set()))
        hours[bar.resource] = hours.get(bar.resource, 0.0) + bar.hours
        steps.add(bar.submission_id)
        if bar.cluster:
            on.setdefault(bar.submission_id, set()).add(bar.cluster)

    on: dict[str, set[str]] = {}  # the clusters each step has bars on

    per_dag: dict[tuple, tuple[dict[str, float], set[str]]] = {}
    per_task: dict[tuple, tuple[dict[str, float], set[str]]] = {}
    for bar in bars:
        dag = ("", True) if bar.hidden else (bar.dag_id or "(no DAG: ad-hoc steps)", False)
        add(per_dag, dag, bar)
        add(per_task, (*dag, "" if bar.hidden else bar.task_id), bar)

    def rows(table: dict, with_task: bool) -> list[UsageRow]:
        out = [UsageRow(dag_id=key[0], task_id=key[2] if with_task else None, steps=len(steps),
                        hours={r: round(hours[r], 6) for r in ACCELERATORS if r in hours}, hidden=key[1],
                        clusters=_where(steps, attempts or {}, on), **_figures(steps, goodput or {}))
               for key, (hours, steps) in table.items()]
        return sorted(out, key=lambda r: (r.hidden, -sum(r.hours.values()), r.dag_id, r.task_id or ""))

    return rows(per_dag, False), rows(per_task, True)


def _where(steps: set[str], attempts: dict[str, dict[str, int]], on: dict[str, set[str]]) -> dict[str, int]:
    """Attempts that held capacity per cluster over a row's steps: a step's records where it has them, else one per
    cluster it has bars on (a running attempt has no record yet)."""
    out: dict[str, int] = {}
    for sid in steps:
        counted = attempts.get(sid) or dict.fromkeys(on.get(sid, ()), 1)
        for name, count in counted.items():
            out[name] = out.get(name, 0) + count
    return dict(sorted(out.items()))


def _figures(steps: set[str], goodput: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A row's goodput fields: its measured steps' chip-hours per category, and productive over held."""
    total = Account()
    measured = [sid for sid in steps if sid in goodput]
    for sid in measured:
        total.add(Account.from_json(goodput[sid]))
    if not measured:
        return {}
    return {"measured": len(measured), "goodput": None if total.goodput is None else round(total.goodput, 6),
            "held_chip_h": round(total.held_chip_s / 3600, 6),
            "chip_h": {name: round(total.chip_s[name] / 3600, 6) for name in CATEGORIES}}


def select(found: Usage, *, dag_id: str | None = None, task_id: str | None = None,
           team: str | None = None) -> list[Bar]:
    """The bars of one DAG, task and/or team (a team also takes its sub-teams: `research` takes `research/vision`)."""
    return [bar for bar in found.bars
            if (dag_id is None or bar.dag_id == dag_id) and (task_id is None or bar.task_id == task_id)
            and (team is None or bar.team == team or bar.team.startswith(team.rstrip("/") + "/"))]


def usage(dashboard_url: str, token: str | None = None, *, hours: float = DEFAULT_WINDOW_H, timeout: float = 20.0,
          verify: bool | str = True, headers: dict[str, str] | None = None) -> Usage:
    """The window's bars and lanes (blocking), read through the Jobs client (its retries, TLS, errors).

    Ray 2.60's `/logical/actors` filters by actor id only, so the whole actor table is read; the
    jobs are read by id, only those of steps in the window, ended ones once (`job_records`).
    """
    with _client(dashboard_url, token, timeout, verify, headers, RayJobsClient) as client:
        nodes, actors = (client.get_json(path, params) for path, params in (_NODES, _ACTORS))
        now = time.time()
        jobs = records_for(client.address).find(client, step_ids(actors, now=now, hours=hours))
        figures = step_goodput.find(client, jobs)
    found = parse(nodes, actors, jobs, now=now, hours=hours,
                  goodput={sid: account.to_json() for sid, account in figures.items()})
    return found


async def ausage(dashboard_url: str, token: str | None = None, *, hours: float = DEFAULT_WINDOW_H,
                 timeout: float = 20.0, verify: bool | str = True, headers: dict[str, str] | None = None) -> Usage:
    """`usage` for async callers (the UI plugin), without stopping their event loop: the actor table
    (up to 100,000 ended actors, whose JSON decode holds the GIL for seconds) is read and cut to the
    window in a child process (`actor_table`), the rest parsed in a thread."""
    now = time.time()
    async with _client(dashboard_url, token, timeout, verify, headers, AsyncRayJobsClient) as client:
        nodes, actors = await asyncio.gather(
            client.get_json(*_NODES),
            aread_window(dashboard_url=dashboard_url, token=token, timeout=timeout, verify=verify,
                         headers=headers, now=now, hours=hours))
        jobs = await records_for(client.address).afind(client, step_ids(actors, now=now, hours=hours))
        figures = await step_goodput.afind(client, jobs)
    found = await asyncio.to_thread(parse, nodes, actors, jobs, now=now, hours=hours,
                                    goodput={sid: account.to_json() for sid, account in figures.items()})
    return found


def render(rows: list[UsageRow], *, title: str) -> Any:
    """A rich table for `rayslice usage`: per row, steps, accelerator-hours, goodput and where the chip-hours went."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    on_clusters = any(row.clusters for row in rows)  # a cluster set's view: where the attempts ran
    for column in ("DAG", "task", "steps", *(("clusters (attempts)",) if on_clusters else ()), "TPU chip-h", "GPU-h",
                   "held chip-h", "goodput", *CATEGORIES):
        table.add_column(column, no_wrap=True, justify="left" if column in ("DAG", "task") else "right")
    for row in rows:
        table.add_row(
            "(hidden)" if row.hidden else row.dag_id, row.task_id or "", str(row.steps),
            *((", ".join(f"{name} ({count})" for name, count in row.clusters.items()),) if on_clusters else ()),
            f"{row.tpu_chip_hours:.4g}", f"{row.gpu_hours:.4g}",
            "-" if row.held_chip_h is None else f"{row.held_chip_h:.4g}",
            "-" if row.goodput is None else f"{row.goodput:.1%}" + ("" if row.measured == row.steps
                                                                    else f" ({row.measured} of {row.steps})"),
            *("-" if not row.chip_h else f"{row.chip_h.get(name, 0.0):.4g}" for name in CATEGORIES))
    return table
