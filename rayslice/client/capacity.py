"""What the accelerators are doing now: every TPU slice and GPU node, who holds it, and what waits.

Runs on the Airflow side (CLI, UI plugin), so it reads Ray's dashboard over HTTP only: the
state API (`/api/v0/nodes`, `/placement_groups`, `/actors`) for who uses which node, and the
Jobs API (`/api/jobs/`) to trace a Ray job back to its DAG, run and task. `_parse` turns the
four responses into a `Snapshot` with no I/O; `snapshot` and `asnapshot` only fetch, through the
Jobs client (`RayJobsClient.get_json`): the same retries, TLS settings, token scrubbing and errors
as every other call to the dashboard.

Which GPU of a node a fractional share sits on, and since when a step's host process runs, are
not in the state API; the dashboard's own `/logical/actors` has both (the worker's
`usedResources` slots, learned from node stats a few seconds after the actor starts, and
`startTime`). It is read for the live actors that hold accelerators, and is best effort: an
older or newer dashboard without it leaves `GpuShare.gpus` empty and `since` unknown.

A host is `running` while a live actor uses its chips, `reserved` while a placement group
bundle holds them (or the slice's head resource) with nothing running yet, else `free`.
Ray tasks that use accelerators without an actor or placement group are not visible here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, computed_field

from rayslice.client.job_records import records_for
from rayslice.client.jobs_client import AsyncRayJobsClient, RayJobsClient
from rayslice.core.exceptions import RaysliceError
from rayslice.core.step import TaskRef

__all__ = ["GpuNode", "GpuShare", "Holder", "Host", "Pending", "Slice", "Snapshot", "asnapshot", "render",
           "snapshot"]

PREFIX = "rayslice:"
#: The placement group (one tiny CPU bundle) a step holds while it waits in the admission queue.
QUEUED_SUFFIX = "/queued"  # launcher.reservation_name: every placement group and actor a step creates
#: A suspended step back in the queue names why in its marker: `rayslice:<id>/suspended: <why>/queued`.
SUSPENDED_INFIX = "/suspended: "
SLICE_LABEL, WORKER_LABEL = "ray.io/tpu-slice-name", "ray.io/tpu-worker-id"
POD_TYPE_LABEL, TOPOLOGY_LABEL = "ray.io/tpu-pod-type", "ray.io/tpu-topology"
_STATE = "/api/v0/{}"
_LOGICAL_ACTORS = "/logical/actors"  # the dashboard's actor view: has each worker's GPU slots
# `nocache=1`: the dashboard otherwise answers an expired cached reply (and refreshes it for the next caller).
_LIMIT = "10000"  # the state API answers 100 rows unless told otherwise
# Skip what cannot hold capacity, server-side: dead actors and removed groups pile up.
_QUERIES = {
    "nodes": {"filter_keys": "state", "filter_predicates": "=", "filter_values": "ALIVE"},
    "placement_groups": {"filter_keys": "state", "filter_predicates": "!=", "filter_values": "REMOVED"},
    "actors": {"filter_keys": "state", "filter_predicates": "!=", "filter_values": "DEAD"},
}
_ACTIVE_ACTORS = ("ALIVE", "PENDING_CREATION", "RESTARTING", "DEPENDENCIES_UNREADY")
_NOT_ACCELERATORS = {"CPU", "memory", "object_store_memory", "bundle"}


class Holder(TaskRef):
    """Who holds capacity: a rayslice step's Airflow task, or whatever Ray job or name we found."""

    submission_id: str = ""
    request: str = ""
    job_id: str | None = None
    job_status: str | None = None
    name: str = ""  # the placement group or actor name, for holders outside rayslice
    cluster_set: str = ""  # a step over several clusters: its set (its job's metadata); its job on each member

    @computed_field
    @property
    def label(self) -> str:
        """"dag/task (run)" for an Airflow task, else the best id we have."""
        if self.dag_id or self.task_id:
            index = f"[{self.map_index}]" if self.map_index >= 0 else ""
            return f"{self.dag_id}/{self.task_id}{index} ({self.run_id})"
        return self.submission_id or self.name or f"Ray job {self.job_id}"


class Host(BaseModel):
    worker_id: int
    node_id: str
    chips: int
    chips_used: float = 0
    state: Literal["free", "reserved", "running"] = "free"
    holder: Holder | None = None
    since: datetime | None = None  # when the step's process on this host started


class Slice(BaseModel):
    name: str
    pod_type: str
    topology: str
    hosts: list[Host]
    chips: int
    state: Literal["free", "reserved", "running", "partial"]
    holder: Holder | None = None
    since: datetime | None = None  # when its holder's first host process started
    held_s: float | None = None  # how long that is, at `taken_at`


class GpuShare(BaseModel):
    holder: Holder
    amount: float
    state: Literal["reserved", "running"] = "running"
    gpus: list[int] = []  # the node's GPU indices Ray gave it (its CUDA_VISIBLE_DEVICES); empty while unknown
    since: datetime | None = None
    held_s: float | None = None


class GpuNode(BaseModel):
    node_id: str
    total: float
    used: float
    shares: list[GpuShare]

    @computed_field
    @property
    def free(self) -> float:
        return max(0.0, round(self.total - self.used, 6))


class Pending(BaseModel):
    """Demand Ray has not placed yet: a placement group or an actor.

    `starting` marks an actor whose request fits the free GPU share right now: it waits for its
    worker process, not for capacity (the state API does not tell the two apart).
    """

    kind: Literal["placement_group", "actor", "queue"]
    request: str
    resources: dict[str, float]
    holder: Holder | None = None
    since: datetime | None = None
    waiting_s: float | None = None
    starting: bool = False
    # In the admission queue (kind "queue"): its rank (priority, then arrival), as the broker orders it.
    priority: int | None = None
    team: str | None = None
    place: int | None = None  # 1 = first in its broker line (a slice type, with chips on it; an accelerator resource)
    arrival: datetime | None = None  # when its launcher took its place (the job's start)
    suspended: str = ""  # back in the queue after a suspension (a preemption notice): why it was suspended


class Snapshot(BaseModel):
    slices: list[Slice]
    gpu_nodes: list[GpuNode]
    pending: list[Pending]
    taken_at: datetime
    warnings: list[str] = []


# --------------------------------------------------------------------------- fetching


def _requests() -> list[tuple[str, dict[str, str]]]:
    return [(_STATE.format(kind), {"detail": "1", "limit": _LIMIT, **query}) for kind, query in _QUERIES.items()]


def _job_refs(groups_body: Any, actors_body: Any) -> set[str]:
    """The jobs the holders name: submission ids in rayslice names, and the creators' job ids."""
    refs = set()
    for pg in _rows(groups_body, "placement groups", []):
        refs |= {_sid(pg.get("name")), pg.get("creator_job_id") or ""}
    for actor in _rows(actors_body, "actors", []):
        resources = actor.get("required_resources") or {}
        if actor.get("state") in _ACTIVE_ACTORS and any(_base(k) not in _NOT_ACCELERATORS
                                                        for k, v in resources.items() if v):
            refs |= {_sid(actor.get("name")), actor.get("job_id") or ""}
    return refs - {""}


def _sid(name: str | None) -> str:
    return name[len(PREFIX):].split("/", 1)[0] if name and name.startswith(PREFIX) else ""


def _gpu_actor_ids(actors_body: Any) -> list[str]:
    """Live actors that hold accelerators: whose GPU slots and start times to look up."""
    return sorted(a["actor_id"] for a in _rows(actors_body, "actors", []) if a.get("state") == "ALIVE"
                  and a.get("actor_id") and (_holds(a.get("required_resources") or {}, "GPU")
                                             or _holds(a.get("required_resources") or {}, "TPU")))


def _gpu_slots(body: Any) -> dict[str, tuple[list[int], float | None]]:
    """actor id -> (GPU indices, start time in s), from `/logical/actors`; {} for anything unexpected."""
    try:
        out = {}
        for actor_id, info in body["data"]["actors"].items():
            if not info:
                continue
            gpu = (info.get("usedResources") or {}).get("GPU")
            slots = sorted(int(slot["slot"]) for slot in gpu["resourceSlots"]) if gpu else []
            started = int(info.get("startTime") or 0) / 1000 or None
            out[actor_id] = (slots, started)
        return out
    except (KeyError, TypeError, AttributeError, ValueError):
        return {}


def _client(dashboard_url: str, token: str | None, timeout: float, verify: bool | str,
            headers: dict[str, str] | None, cls: type[Any]) -> Any:
    return cls(dashboard_url, token=token, timeout=timeout, verify=verify, headers=headers)


def snapshot(dashboard_url: str, token: str | None = None, *, timeout: float = 10.0, verify: bool | str = True,
             headers: dict[str, str] | None = None) -> Snapshot:
    """Read the cluster's accelerators, holders and pending demand (blocking).

    `verify` and `headers` are the `ray` connection's extras (a CA bundle, a proxy's header). The
    reads go through the Jobs client: its retries, token scrubbing and errors.
    """
    with _client(dashboard_url, token, timeout, verify, headers, RayJobsClient) as client:
        bodies = [client.get_json(path, params) for path, params in _requests()]
        jobs = records_for(client.address).find(client, _job_refs(bodies[1], bodies[2]))
        slots: dict[str, tuple[list[int], float | None]] = {}
        if ids := _gpu_actor_ids(bodies[2]):
            with contextlib.suppress(RaysliceError):  # best effort: the shares stay without their GPU index
                slots = _gpu_slots(client.get_json(_LOGICAL_ACTORS, {"ids": ",".join(ids), "nocache": "1"}))
    return _parse(*bodies, jobs, now=time.time(), gpu_slots=slots)


async def asnapshot(dashboard_url: str, token: str | None = None, *, timeout: float = 10.0,
                    verify: bool | str = True, headers: dict[str, str] | None = None) -> Snapshot:
    """`snapshot` for async callers (the UI plugin): the reads run concurrently, the parsing in a thread."""
    async with _client(dashboard_url, token, timeout, verify, headers, AsyncRayJobsClient) as client:
        bodies = await asyncio.gather(*(client.get_json(path, params) for path, params in _requests()))
        actors = _gpu_actor_ids(bodies[2])
        jobs = records_for(client.address).afind(client, _job_refs(bodies[1], bodies[2]))
        lookup = client.get_json(_LOGICAL_ACTORS, {"ids": ",".join(actors), "nocache": "1"}) if actors else None
        jobs, slots = await asyncio.gather(jobs, _best_effort(lookup))
    return await asyncio.to_thread(lambda: _parse(*bodies, jobs, now=time.time(), gpu_slots=slots))


async def _best_effort(lookup: Any) -> dict[str, tuple[list[int], float | None]]:
    """The GPU slots, or none (as in `snapshot`): an older dashboard without `/logical/actors` is no error."""
    try:
        return _gpu_slots(await lookup) if lookup else {}
    except RaysliceError:
        return {}


# --------------------------------------------------------------------------- parsing


def _rows(body: Any, kind: str, warnings: list[str]) -> list[dict[str, Any]]:
    result = body.get("data", {}).get("result", {}) if isinstance(body, dict) else {}
    if result.get("partial_failure_warning"):
        warnings.append(f"{kind}: {result['partial_failure_warning']}")
    if result.get("num_after_truncation", 0) < result.get("num_filtered", 0):
        warnings.append(f"{kind}: only {result['num_after_truncation']} of {result['num_filtered']} listed")
    return list(result.get("result") or [])


class _Holders:
    """Traces placement groups and actors to their Ray job, and jobs to their Airflow task."""

    def __init__(self, jobs: list[dict[str, Any]]) -> None:
        self.by_sid = {j["submission_id"]: j for j in jobs if j.get("submission_id")}
        self.by_job_id = {j["job_id"]: j for j in jobs if j.get("job_id")}

    def find(self, name: str | None, job_id: str | None) -> Holder:
        name = name or ""
        sid = name[len(PREFIX):].split("/", 1)[0] if name.startswith(PREFIX) else ""
        job = self.by_sid.get(sid) if sid else None
        job = job or self.by_job_id.get(job_id or "")
        if job is None:
            return Holder(submission_id=sid, job_id=job_id, name="" if sid else name)
        meta = job.get("metadata") or {}
        return Holder(
            submission_id=sid or job.get("submission_id") or "", **TaskRef.fields_from(meta),
            request=meta.get("request", ""), job_id=job.get("job_id") or job_id, job_status=job.get("status"),
            name="" if sid or job.get("submission_id") else name, cluster_set=meta.get("cluster_set", ""),
        )


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _base(resource: str) -> str:
    """`TPU_group_0_<pg id>` and `TPU_group_<pg id>` (resources inside a placement group) -> `TPU`."""
    return resource.split("_group_", 1)[0]


def _holds(resources: dict[str, float], name: str) -> bool:
    """Whether a bundle or actor asks for `name` chips, or (for "TPU") a slice's `TPU-<pod>-head`."""
    return any(_base(k) == name or (name == "TPU" and _base(k).startswith("TPU-") and _base(k).endswith("-head"))
               for k, v in resources.items() if v)


def _describe(resources: dict[str, float]) -> str:
    keep = {k: v for k, v in resources.items() if _base(k) not in _NOT_ACCELERATORS}
    return ", ".join(f"{k} x{v:g}" for k, v in sorted((keep or resources).items())) or "nothing"


def _parse(nodes_body: Any, groups_body: Any, actors_body: Any, jobs: Any, *, now: float,
           gpu_slots: dict[str, tuple[list[int], float | None]] | None = None) -> Snapshot:
    warnings: list[str] = []
    nodes = [n for n in _rows(nodes_body, "nodes", warnings) if n.get("state") == "ALIVE"]
    groups = _rows(groups_body, "placement groups", warnings)
    actors = [a for a in _rows(actors_body, "actors", warnings) if a.get("state") in _ACTIVE_ACTORS]
    holders = _Holders(jobs if isinstance(jobs, list) else [])
    pg_holder = {pg["placement_group_id"]: holders.find(pg.get("name"), pg.get("creator_job_id")) for pg in groups}

    # Per node: what holds it, as (state, holder, TPU chips, GPUs, GPU indices, start time).
    usage: dict[str, list[tuple[str, Holder, float, float, list[int], float | None]]] = {}
    for pg in groups:
        if pg.get("state") != "CREATED":
            continue
        for bundle in pg.get("bundles") or []:
            res = bundle.get("unit_resources") or {}
            if bundle.get("node_id") and (_holds(res, "TPU") or _holds(res, "GPU")):
                usage.setdefault(bundle["node_id"], []).append(
                    ("reserved", pg_holder[pg["placement_group_id"]], res.get("TPU", 0), res.get("GPU", 0), [], None))
    for actor in actors:
        res = actor.get("required_resources") or {}
        if actor.get("state") != "ALIVE" or not actor.get("node_id") or not (_holds(res, "TPU") or _holds(res, "GPU")):
            continue
        holder = holders.find(actor.get("name"), actor.get("job_id"))
        in_group = bool(actor.get("placement_group_id"))  # its bundle already counts the chips
        slots, started = (gpu_slots or {}).get(actor.get("actor_id") or "", ([], None))
        usage.setdefault(actor["node_id"], []).append(
            ("running", holder, 0 if in_group else res.get("TPU", 0), 0 if in_group else res.get("GPU", 0),
             slots, started))

    gpu_nodes = _gpu_nodes(nodes, usage, now)
    gpu_free = max((n.free for n in gpu_nodes), default=0)
    slices = _slices(nodes, usage, now)
    return Snapshot(slices=slices, gpu_nodes=gpu_nodes,
                    pending=_rank_queue(_pending(groups, actors, pg_holder, holders, now, gpu_free), slices),
                    taken_at=datetime.fromtimestamp(now, UTC), warnings=warnings)


def _since(started: float | None, now: float) -> dict[str, Any]:
    """`since` (whole seconds) and `held_s` for a holder that started at `started`."""
    if not started:
        return {}
    return {"since": datetime.fromtimestamp(int(started), UTC), "held_s": round(max(0.0, now - int(started)), 1)}


def _slices(nodes: list[dict[str, Any]], usage: dict[str, list], now: float) -> list[Slice]:
    by_slice: dict[str, list[dict[str, Any]]] = {}
    for node in nodes:
        labels = node.get("labels") or {}
        if labels.get(SLICE_LABEL) and (node.get("resources_total") or {}).get("TPU"):
            by_slice.setdefault(labels[SLICE_LABEL], []).append(node)
    slices = []
    for name, members in sorted(by_slice.items()):
        hosts = sorted((_host(node, usage.get(node["node_id"], [])) for node in members), key=lambda h: h.worker_id)
        held = [h for h in hosts if h.state != "free"]
        state = ("free" if not held else "partial" if len(held) < len(hosts)
                 else "running" if any(h.state == "running" for h in hosts) else "reserved")
        owners = Counter(h.holder.model_dump_json() for h in held if h.holder)
        holder = Holder.model_validate_json(owners.most_common(1)[0][0]) if owners else None
        labels = members[0].get("labels") or {}
        starts = [h.since.timestamp() for h in held if h.since and h.holder == holder]
        slices.append(Slice(name=name, pod_type=labels.get(POD_TYPE_LABEL, ""), topology=labels.get(TOPOLOGY_LABEL, ""),
                            hosts=hosts, chips=sum(h.chips for h in hosts), state=state, holder=holder,
                            **_since(min(starts, default=None), now)))
    return slices


def _host(node: dict[str, Any], uses: list[tuple[str, Holder, float, float, list[int], float | None]]) -> Host:
    labels = node.get("labels") or {}
    running = [u for u in uses if u[0] == "running"]
    chosen = (running or uses or [None])[0]
    return Host(worker_id=_int(labels.get(WORKER_LABEL), 0), node_id=node["node_id"],
                chips=int((node.get("resources_total") or {}).get("TPU", 0)),
                chips_used=sum(u[2] for u in uses), state="running" if running else "reserved" if uses else "free",
                holder=chosen[1] if chosen else None,
                since=datetime.fromtimestamp(int(chosen[5]), UTC) if chosen and chosen[5] else None)


def _gpu_nodes(nodes: list[dict[str, Any]], usage: dict[str, list], now: float) -> list[GpuNode]:
    out = []
    for node in nodes:
        total = (node.get("resources_total") or {}).get("GPU", 0)
        if not total:
            continue
        shares = [GpuShare(holder=h, amount=g, state=s, gpus=i, **_since(t, now))
                  for s, h, _, g, i, t in usage.get(node["node_id"], []) if g]
        out.append(GpuNode(node_id=node["node_id"], total=total, used=round(sum(s.amount for s in shares), 6),
                           shares=shares))
    return sorted(out, key=lambda n: n.node_id)


def _pending(groups: list[dict[str, Any]], actors: list[dict[str, Any]], pg_holder: dict[str, Holder],
             holders: _Holders, now: float, gpu_free: float) -> list[Pending]:
    out = []
    for pg in groups:
        if (pg.get("name") or "").endswith(QUEUED_SUFFIX):  # a step waiting in the cluster's admission queue
            created_ns = _int((pg.get("stats") or {}).get("creation_request_received_ns"), 0)
            job = holders.by_job_id.get(pg.get("creator_job_id") or "") or {}
            started = job.get("start_time") / 1000 if job.get("start_time") else None  # its driver queues at once
            demand = _demand("queue", {}, pg_holder[pg["placement_group_id"]], created_ns / 1e9 or started, now)
            meta = job.get("metadata") or {}
            demand.priority, demand.team = _int(meta.get("priority"), 0), meta.get("team") or None
            demand.arrival = datetime.fromtimestamp(started, UTC) if started else None
            name = pg.get("name") or ""
            if SUSPENDED_INFIX in name:
                demand.suspended = name.split(SUSPENDED_INFIX, 1)[1][:-len(QUEUED_SUFFIX)]
            out.append(demand)
            continue
        if pg.get("state") not in ("PENDING", "RESCHEDULING"):
            continue
        resources: Counter[str] = Counter()
        for bundle in pg.get("bundles") or []:
            resources.update(bundle.get("unit_resources") or {})
        created_ns = _int((pg.get("stats") or {}).get("creation_request_received_ns"), 0)
        holder = pg_holder[pg["placement_group_id"]]
        out.append(_demand("placement_group", dict(resources), holder, created_ns / 1e9 or None, now))
    for actor in actors:
        res = actor.get("required_resources") or {}
        if actor.get("state") != "PENDING_CREATION" or actor.get("placement_group_id"):
            continue  # an actor inside a created group is starting, not waiting for capacity
        if not any(_base(k) not in _NOT_ACCELERATORS for k in res):
            continue
        holder = holders.find(actor.get("name"), actor.get("job_id"))
        job = holders.by_job_id.get(actor.get("job_id") or "") or {}
        started = job.get("start_time") / 1000 if job.get("start_time") else None  # the launcher asks at once
        demand = _demand("actor", res, holder, started, now)
        accelerators = {_base(k) for k in res if _base(k) not in _NOT_ACCELERATORS}
        demand.starting = accelerators == {"GPU"} and res.get("GPU", 0) <= min(gpu_free, 1.0)
        out.append(demand)
    return sorted(out, key=lambda p: (p.starting, -(p.waiting_s or 0)))


def _rank_queue(pending: list[Pending], slices: list[Slice]) -> list[Pending]:
    """Number the queued steps in line, in the broker's lines and order (`rayslice.core.queue`).

    A line is a kind of capacity: a slice type ("v6e-16"), an accelerator resource ("GPU"), and TPU
    chips wait in the line of the slice type they run on (`chip_slice_type` over this cluster's
    slices), with that type's slice steps; chips no slice's hosts hold wait in a "TPU" line. Within
    a line: priority, then arrival, the job's start (its launcher takes its place then, and keeps
    that arrival through retries), not when its marker group was made (that breaks ties).
    """
    from rayslice.core import queue as rules

    types: dict[str, tuple[int, int]] = {}  # pod type -> (chips per host, chips per slice), as the launcher reads it
    for s in slices:
        if s.pod_type and s.hosts:
            types[s.pod_type] = max(types.get(s.pod_type, (0, 0)), (max(h.chips for h in s.hosts), s.chips))
    never = datetime.max.replace(tzinfo=UTC)
    queued = sorted((p for p in pending if p.kind == "queue"), key=lambda p: p.since or never)
    read: dict[str, tuple[Any, tuple[str, int] | None]] = {}  # request text -> (request, chips_on): once each
    entries, by_id = [], {}
    for i, p in enumerate(queued):
        if p.request not in read:
            request = _request(p.request)
            read[p.request] = (request, _chips_on(request, types))
        request, chips_on = read[p.request]
        entry = rules.entry_for(request, id=f"{i:09d}", label="", priority=p.priority or 0,
                                arrival=(p.arrival or p.since or never).timestamp(), chips_on=chips_on)
        entries.append(entry)
        by_id[entry.id] = p
    for id, (place, _) in rules.ranks(entries).items():
        by_id[id].place = place
    return pending


def _request(text: str) -> Any:
    """The request a job's metadata names (`str(request)`), enough to tell its line: "v6e-16 x2 (multislice)" ->
    a `v6e-16` slice; "TPU x4 (TPU-V6E)" -> 4 TPU chips of v6e; "GPU x0.25" -> a quarter GPU."""
    from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest

    words = text.split(" ", 2)
    head = words[0] if words else ""
    try:
        if head in ("GPU", "NPU", "TPU", "neuron_cores", "HPU"):
            count = float(words[1].removeprefix("x")) if len(words) > 1 else 1.0
            pinned = words[2].strip("()") if len(words) > 2 else None
            return AcceleratorRequest(resource=head, count=count, accelerator_type=pinned)
        return TpuSliceRequest(tpu=head)
    except Exception:  # a request this rayslice cannot read: a line of its own name
        return AcceleratorRequest.model_construct(kind="accelerator", resource=head or "?", count=1.0,
                                                  accelerator_type=None)


def _chips_on(request: Any, types: dict[str, tuple[int, int]]) -> tuple[str, int] | None:
    """The slice type TPU chips wait for, and its chips per slice, as the launcher picks it (None: not chips,
    or no slice here holds them)."""
    from rayslice.core.queue import chip_slice_type

    if getattr(request, "resource", None) != "TPU":
        return None
    pod_type = chip_slice_type(request.count, request.accelerator_type, types)
    return None if pod_type is None else (pod_type, types[pod_type][1])


def _demand(kind: str, resources: dict[str, float], holder: Holder, since: float | None, now: float) -> Pending:
    return Pending(kind=kind, request=holder.request or _describe(resources), resources=resources, holder=holder,
                   since=datetime.fromtimestamp(since, UTC) if since else None,
                   waiting_s=round(max(0.0, now - since), 1) if since else None)


# --------------------------------------------------------------------------- rendering

_COLORS = {"free": "green", "reserved": "yellow", "running": "magenta", "partial": "cyan"}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    minutes, sec = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{sec:02d}s" if minutes else f"{sec}s"


def _queue_place(p: Pending) -> str:
    """ "2nd in line, priority 5, team research"."""
    from rayslice.core.queue import ordinal

    return ", ".join(part for part in (f"{ordinal(p.place)} in line" if p.place else "",
                                       f"priority {p.priority}" if p.priority is not None else "",
                                       f"team {p.team}" if p.team else "",
                                       f"suspended: {p.suspended}" if p.suspended else "") if part)


def _indices(gpus: list[int]) -> str:
    return ",".join(map(str, gpus))


def render(snap: Snapshot, *, pending: bool = True) -> Any:
    """Rich tables for `rayslice capacity`: slices, GPU nodes, then pending demand (`pending=False`: a member of a
    cluster set, whose demand the set's queue shows once across its members: `set_capacity.render`)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    slices = Table(title="TPU slices", title_justify="left")
    for column in ("slice", "pod type", "hosts", "chips", "state"):
        slices.add_column(column, no_wrap=True)
    slices.add_column("holder", overflow="fold")
    for s in snap.slices:
        hosts = Text()
        for host in s.hosts:  # one square per host, in its state's color
            hosts.append("■", style=_COLORS[host.state])
        slices.add_row(s.name, f"{s.pod_type} ({s.topology})", hosts, str(s.chips),
                       Text(s.state, style=_COLORS[s.state]), s.holder.label if s.holder else "")
    gpus = Table(title="GPU nodes", title_justify="left")
    for column in ("node", "total", "used", "free"):
        gpus.add_column(column, no_wrap=True)
    gpus.add_column("users", overflow="fold")
    for n in snap.gpu_nodes:
        users = ", ".join(f"{share.holder.label} x{share.amount:g}" + (f" on GPU {_indices(share.gpus)}"
                                                                           if share.gpus else "")
                          for share in n.shares)
        gpus.add_row(n.node_id[:12], f"{n.total:g}", f"{n.used:g}", f"{n.free:g}", users)
    parts: list[Any] = [slices, gpus]
    if pending and snap.pending:
        table = Table(title="Pending demand", title_justify="left")
        for column in ("request", "holder", "waiting"):
            table.add_column(column, overflow="fold")
        for p in snap.pending:
            wait = "starting (capacity is free)" if p.starting else _duration(p.waiting_s)
            if p.kind == "queue":
                wait += f" (in the admission queue: {_queue_place(p)})"
            table.add_row(p.request, p.holder.label if p.holder else "", wait)
        parts.append(table)
    elif pending:
        parts.append(Text("No pending demand.", style="dim"))
    parts += [Text(f"warning: {w}", style="red") for w in snap.warnings]
    return Group(*parts)
