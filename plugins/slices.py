"""The Airflow UI's **Slices** page: the Ray cluster's TPU slices and GPU nodes, who holds them, what waits.

An Airflow 3 plugin: a FastAPI app mounted at `/rayslice` (the page, and the JSON it refreshes
from) and a nav entry that shows the page inside the UI. Importing this module is cheap: the
app (FastAPI, Airflow's API security) is built only when Airflow reads `fastapi_apps`, which
only the API server does.

Every route takes the same credentials as Airflow's own API (the UI's `_token` cookie or an
`Authorization: Bearer` JWT) and needs the "cluster activity" view; holders in DAGs the user
may not read are shown as hidden. The `ray` connection's token never leaves the server.
Only a user allowed to read connections may point the page at another connection
(`?conn_id=`); anyone else asking for one gets the same refusal whether it exists or not.
The Ray dashboard's URL (the header link, job links, the JSON's `dashboard_url`) is shown only
to users allowed to read the connection it comes from; the "Ray job" extra link of a task goes
through `/rayslice/job/<submission id>`, which checks the same before it redirects there. Given a
cluster set, it leads to the member whose job ran the step (that member's connection must be readable
too), and the usage joins every member's.

Below the live view, a usage timeline of the last hours (`?hours=`) and the accelerator-hours
per DAG and task over it (`rayslice.client.usage`), drawn on the server too.
"""

# No `from __future__ import annotations`: FastAPI must see the route signatures' real types,
# which are imported inside build_app().
import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from functools import cache
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

from airflow.plugins_manager import AirflowPlugin

if TYPE_CHECKING:
    from fastapi import FastAPI
    from rayslice.hooks.ray import ClusterSetSettings, RayConnectionSettings

    from rayslice.client.capacity import Snapshot
    from rayslice.client.set_capacity import SetSnapshot
    from rayslice.client.usage import Usage

URL_PREFIX = "/rayslice"
DEFAULT_CONN_ID = "ray_default"
CACHE_S = 2.0  # many open pages share one reading of the cluster
USAGE_CACHE_S = 10.0  # the usage reading lists every ended actor: read it less often
NO_DASHBOARD = ("the Ray job's page is in the Ray dashboard, whose address only users allowed to read the "
                "task's `ray` connection may see; ask an Airflow admin for that permission")
NOT_YOURS = ("only users allowed to read Airflow connections may choose the page's connection; "
             "open the page without ?conn_id= for the default one")
HIDDEN = "a task in a DAG you cannot read"
_CONN_ID = re.compile(r"^[\w.-]{1,250}$")
#: What a Ray submission id may hold (rayslice's are `rayslice-...`; plain Ray ones `raysubmit_...`).
_SUBMISSION_ID = re.compile(r"^[\w.:-]{1,500}$")
_ICON = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" fill="none" stroke="#5b5bd6" stroke-width="2">'
         + "".join(f'<rect x="{x}" y="{y}" width="7" height="7" rx="1"/>' for x in (3, 14) for y in (3, 14))
         + "</svg>")


class SlicesPlugin(AirflowPlugin):
    """Adds the Slices page (`/rayslice/`) and its nav entry to the Airflow 3 UI."""

    name = "rayslice_slices"
    external_views = [{
        "name": "Slices",
        "href": f"{URL_PREFIX}/",
        "destination": "nav",
        "url_route": "slices",
        "nav_top_level": True,
        "icon": f"{URL_PREFIX}/icon.svg",
    }]

    @property
    def fastapi_apps(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [{"name": "rayslice_slices", "app": build_app(), "url_prefix": URL_PREFIX}]


class _Problem(Exception):
    """A reading failed for a reason the user can act on; `status` is the JSON API's answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def ray_connection(conn_id: str) -> "RayConnectionSettings":
    """The `ray` connection, resolved as the hook does: host is the dashboard URL, password the token."""
    from rayslice.hooks.ray import settings_from_connection

    from rayslice.core.exceptions import RaysliceError

    conn = _ray_conn(conn_id)
    try:
        return settings_from_connection(conn)
    except RaysliceError as exc:
        raise _Problem(400, str(exc)) from None


def cluster_set(conn_id: str) -> "ClusterSetSettings | None":
    """The cluster set `conn_id` names (its extra `clusters`), or None for a connection to one cluster."""
    from rayslice.hooks.ray import cluster_set_of

    from rayslice.core.exceptions import RaysliceError

    try:
        return cluster_set_of(_ray_conn(conn_id))
    except RaysliceError as exc:
        raise _Problem(400, str(exc)) from None


def _ray_conn(conn_id: str) -> Any:
    """The Airflow connection `conn_id`, of type `ray`; a _Problem that says what is wrong otherwise."""
    from airflow.sdk import BaseHook

    if not _CONN_ID.match(conn_id):
        raise _Problem(400, f"{conn_id!r} is not a connection id")
    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception as exc:  # AirflowNotFoundException, or a secrets backend error
        raise _Problem(404, f"no Airflow connection {conn_id!r} ({type(exc).__name__}); add one of type `ray` "
                            "whose host is the Ray dashboard URL, e.g. http://ray-head:8265") from None
    if (conn.conn_type or "").lower() != "ray":
        raise _Problem(400, f"connection {conn_id!r} is of type {conn.conn_type!r}, not `ray`")
    return conn


def scrub(message: str, ray: "RayConnectionSettings") -> str:
    """An error for the page without the connection's secrets: its token and every header value it sends."""
    for secret in sorted({ray.token or "", *ray.headers.values()}, key=len, reverse=True):
        if secret:
            message = message.replace(secret, "***")
    return message


_readings: "dict[str, tuple[float, Snapshot]]" = {}
_set_readings: "dict[str, tuple[float, tuple[SetSnapshot, dict[str, str]]]]" = {}
_usages: "dict[str, tuple[float, Usage]]" = {}
_inflight: "dict[tuple[int, str], asyncio.Future[Any]]" = {}
T = TypeVar("T")


async def shared(key: str, read: Callable[[], Awaitable[T]]) -> T:
    """`read()`, once for every caller asking for `key` meanwhile: pages whose cache missed together share a reading.

    A caller that goes away (its request cancelled) does not cancel the reading the others wait for.
    """
    slot = (id(asyncio.get_running_loop()), key)
    reading = _inflight.get(slot)
    if reading is None:
        reading = _inflight[slot] = asyncio.ensure_future(read())
        reading.add_done_callback(lambda _: _inflight.pop(slot, None))
    return await asyncio.shield(reading)


def may_read_connection(conn_id: str, user: Any) -> bool:
    """Whether the auth manager lets `user` read the connection `conn_id` (and so see its dashboard URL)."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import ConnectionDetails

    return get_auth_manager().is_authorized_connection(method="GET", details=ConnectionDetails(conn_id=conn_id),
                                                       user=user)


def may_choose(conn_id: str, user: Any) -> bool:
    """The default connection is everyone's; another one only for users who may read connections."""
    return conn_id == DEFAULT_CONN_ID or may_read_connection(conn_id, user)


async def shown_dashboard(conn_id: str, user: Any, dashboard: str) -> str:
    """The dashboard URL for a user who may read the connection, else "" (no link is drawn)."""
    from starlette.concurrency import run_in_threadpool

    return dashboard if dashboard and await run_in_threadpool(may_read_connection, conn_id, user) else ""


async def read_usage(conn_id: str, hours: float) -> "Usage":
    """The usage over the last `hours` for `conn_id` (cached for USAGE_CACHE_S); a cluster set's members joined."""
    from starlette.concurrency import run_in_threadpool

    from rayslice.client import usage
    from rayslice.core.exceptions import RaysliceError

    members = await run_in_threadpool(set_members, conn_id)
    if members is not None:
        return await read_set_usage(members, hours)
    ray = await run_in_threadpool(ray_connection, conn_id)
    key = f"{conn_id} {ray.dashboard_url} {hours}"
    cached = _usages.get(key)
    if cached and time.monotonic() - cached[0] < USAGE_CACHE_S:
        return cached[1]
    try:
        found = await shared(f"usage {key}", lambda: usage.ausage(
            ray.dashboard_url, token=ray.token, hours=hours, verify=ray.verify, headers=ray.headers))
    except RaysliceError as exc:
        raise _Problem(502, scrub(str(exc), ray)) from None
    _usages[key] = (time.monotonic(), found)
    return found


async def read_set_usage(members: tuple[str, ...], hours: float) -> "Usage":
    """A cluster set's usage: each member's reading (its own cache), joined (`usage.merge`); a member that cannot be
    read is named in `unread` and left out; none readable: the first one's problem."""
    from rayslice.client import usage

    answers = await asyncio.gather(*(read_usage(name, hours) for name in members), return_exceptions=True)
    found = {name: a for name, a in zip(members, answers, strict=True) if not isinstance(a, BaseException)}
    unread = {name: str(a) for name, a in zip(members, answers, strict=True) if isinstance(a, _Problem)}
    for answer in answers:
        if isinstance(answer, BaseException) and not isinstance(answer, _Problem):
            raise answer
    if not found:
        raise next(a for a in answers if isinstance(a, _Problem))
    return usage.merge(found, unread)


def visible_usage(found: "Usage", user: Any) -> dict[str, Any]:
    """The usage as JSON with steps of no DAG this user may read unnamed, and the per-DAG/task tables.

    A bar without a DAG (its job record deleted, or never an Airflow task's) is hidden too: its
    submission id spells the DAG and task it came from.
    """
    from airflow.api_fastapi.app import get_auth_manager

    from rayslice.client import usage

    dag_ids = {b.dag_id for b in found.bars if b.dag_id}
    allowed = get_auth_manager().filter_authorized_dag_ids(dag_ids=dag_ids, user=user) if dag_ids else set()
    steps: dict[str, str] = {}  # a hidden step keeps a number of its own (its bars on two lanes: one step)
    bars = [b if b.dag_id and b.dag_id in allowed else b.model_copy(update={
        "submission_id": steps.setdefault(b.submission_id, f"hidden-{len(steps) + 1}"), "dag_id": "", "run_id": "",
        "task_id": "", "map_index": -1, "try_number": 0, "request": "", "job_id": None, "job_status": None,
        "hidden": True}) for b in found.bars]
    # The goodput figures under the ids the bars now carry: a hidden step's real id never reaches the page.
    figures = {new.submission_id: found.goodput[old.submission_id]
               for old, new in zip(found.bars, bars, strict=True) if old.submission_id in found.goodput}
    attempts = {new.submission_id: found.attempts[old.submission_id]
                for old, new in zip(found.bars, bars, strict=True) if old.submission_id in found.attempts}
    by_dag, by_task = usage.totals(bars, figures, attempts)
    data = found.model_copy(update={"bars": bars, "goodput": figures, "attempts": attempts}).model_dump(mode="json")
    return {**data, "by_dag": [r.model_dump(mode="json") for r in by_dag],
            "by_task": [r.model_dump(mode="json") for r in by_task]}


def window(hours: float | None) -> float:
    """The timeline's window: one of usage.WINDOWS_H (anything else: the default)."""
    from rayslice.client import usage

    return hours if hours in usage.WINDOWS_H else usage.DEFAULT_WINDOW_H


async def read(conn_id: str) -> "tuple[Snapshot, str]":
    """The cluster's capacity for `conn_id` (cached for CACHE_S) and its dashboard URL (no credentials)."""
    from starlette.concurrency import run_in_threadpool

    from rayslice.client import capacity
    from rayslice.core.exceptions import RaysliceError

    ray = await run_in_threadpool(ray_connection, conn_id)
    key = f"{conn_id} {ray.dashboard_url}"
    cached = _readings.get(key)
    if cached and time.monotonic() - cached[0] < CACHE_S:
        return cached[1], ray.dashboard_url
    try:
        snap = await shared(f"capacity {key}", lambda: capacity.asnapshot(
            ray.dashboard_url, token=ray.token, verify=ray.verify, headers=ray.headers))
    except RaysliceError as exc:
        raise _Problem(502, scrub(str(exc), ray)) from None
    _readings[key] = (time.monotonic(), snap)
    return snap, ray.dashboard_url


async def read_set(conn_id: str, clusters: "ClusterSetSettings") -> "tuple[SetSnapshot, dict[str, str]]":
    """A cluster set's capacity and its members' dashboard URLs (no credentials): each member read as `read` reads
    it (its own cache, its own shared reading; one that fails is kept with why), then the queue across them; the
    whole cached for CACHE_S."""
    from starlette.concurrency import run_in_threadpool

    from rayslice.client import set_capacity
    from rayslice.core.exceptions import RaysliceError

    key = f"{conn_id} {' '.join(clusters.members)}"
    cached = _set_readings.get(key)
    if cached and time.monotonic() - cached[0] < CACHE_S:
        return cached[1]

    def source(member: str) -> "set_capacity.Source":
        try:
            ray = ray_connection(member)
        except _Problem as exc:
            return set_capacity.Source(member, problem=str(exc))
        return set_capacity.Source(member, ray.dashboard_url, ray.token, ray.verify, dict(ray.headers))

    async def member_snapshot(member: "set_capacity.Source") -> "Snapshot":
        try:
            return (await read(member.name))[0]
        except _Problem as exc:  # already scrubbed of that member's secrets
            raise RaysliceError(str(exc)) from None

    async def joined() -> "tuple[SetSnapshot, dict[str, str]]":
        sources = [await run_in_threadpool(source, member) for member in clusters.members]
        found = await set_capacity.aread(conn_id, sources, reader=member_snapshot)
        return found, {s.name: s.dashboard_url for s in sources}

    found = await shared(f"set {key}", joined)
    _set_readings[key] = (time.monotonic(), found)
    return found


async def capacity_data(conn_id: str, user: Any) -> tuple[dict[str, Any], str]:
    """What the page and its JSON show for `conn_id`, as this user may see it, and the dashboard URL to link.

    A cluster set: every member's capacity under its name (its dashboard URL only for users who may read that
    member's connection), and the queue across them; the set has no dashboard of its own."""
    from starlette.concurrency import run_in_threadpool

    clusters = await run_in_threadpool(cluster_set, conn_id)
    if clusters is None:
        snap, dashboard = await read(conn_id)
        data = await run_in_threadpool(visible, snap, user)  # auth managers may ask their database
        return data, await shown_dashboard(conn_id, user, dashboard)
    found, urls = await read_set(conn_id, clusters)
    data = await run_in_threadpool(visible_set, found, user)
    for member in data["members"]:
        url = urls.get(member["name"], "")
        member["dashboard_url"] = await shown_dashboard(member["name"], user, url)
        if url and not member["dashboard_url"]:  # why it failed, without the address this user may not see
            member["error"] = member["error"].replace(url, f"cluster {member['name']}'s dashboard")
    return data, ""


def visible_set(found: "SetSnapshot", user: Any) -> dict[str, Any]:
    """The set's reading as JSON, every member's holders and the queue's hidden as `visible` hides them."""
    data = found.model_dump(mode="json")
    snaps = [m["snapshot"] for m in data["members"] if m["snapshot"] is not None]
    _hide({"slices": [s for snap in snaps for s in snap["slices"]],
           "gpu_nodes": [n for snap in snaps for n in snap["gpu_nodes"]],
           "pending": [p for snap in snaps for p in snap["pending"]] + [row["demand"] for row in data["queue"]]}, user)
    return data


def visible(snap: "Snapshot", user: Any) -> dict[str, Any]:
    """The snapshot as JSON, with holders of no DAG this user may read replaced by a hidden one.

    That includes holders Ray cannot trace to a DAG (a step whose job record was deleted, another
    Ray workload): their names are whatever their creator chose. What hidden demand asks for, and its
    team, are hidden too (its place in line and priority stay: they say why a visible step waits).
    """
    return _hide(snap.model_dump(mode="json"), user)


def _hide(data: dict[str, Any], user: Any) -> dict[str, Any]:
    """`visible`'s rule over a snapshot's JSON (its slices, GPU nodes and pending demand), in place."""
    from airflow.api_fastapi.app import get_auth_manager

    holders = [s["holder"] for s in data["slices"]] + [h["holder"] for s in data["slices"] for h in s["hosts"]]
    holders += [sh["holder"] for n in data["gpu_nodes"] for sh in n["shares"]]
    holders += [p["holder"] for p in data["pending"]]
    dag_ids = {h["dag_id"] for h in holders if h and h["dag_id"]}
    allowed = get_auth_manager().filter_authorized_dag_ids(dag_ids=dag_ids, user=user) if dag_ids else set()
    for holder in holders:
        if holder and holder["dag_id"] not in allowed:
            holder.update(submission_id="", dag_id="", run_id="", task_id="", map_index=-1, try_number=0, request="",
                          job_id=None, job_status=None, name="", label=HIDDEN, cluster_set="")
    for demand in data["pending"]:
        if not demand["holder"] or demand["holder"]["label"] == HIDDEN:
            demand.update(request="hidden", resources={}, team=None)
    return data


#: A member of a set that could not be asked for a job (`set_jobs`).
UNHEARD = "unheard"


def set_members(conn_id: str) -> tuple[str, ...] | None:
    """The member connections of `conn_id` when it is a cluster set (`cluster_set`), else None."""
    clusters = cluster_set(conn_id)
    return None if clusters is None else clusters.members


async def set_jobs(submission_id: str, members: tuple[str, ...]) -> "dict[str, tuple[Any, str]]":
    """Each member's record of the job and the job's dashboard page; the record is None where the member has no
    such job, and `UNHEARD` where it could not be asked (its connection does not resolve, its dashboard is down)."""
    from starlette.concurrency import run_in_threadpool

    from rayslice.core.exceptions import JobNotFoundError, RaysliceError

    async def one(name: str) -> "tuple[Any, str]":
        try:
            ray = await run_in_threadpool(ray_connection, name)
        except _Problem:
            return UNHEARD, ""
        url = ray.job_url(quote(submission_id, safe=""))
        try:
            async with ray.async_client() as client:
                return await client.get(submission_id), url
        except JobNotFoundError:  # skipped at submission
            return None, url
        except RaysliceError:
            return UNHEARD, url

    found = await asyncio.gather(*(one(name) for name in members))
    return dict(zip(members, found, strict=True))


def set_job_page(submission_id: str, conn_id: str, jobs: "dict[str, tuple[Any, str]]",
                 readable: dict[str, bool]) -> str:
    """A set's step whose records do not yet say which member runs it: each member's job, linked where the user
    may read that member's connection (its dashboard's address is shown to no one else)."""
    from html import escape

    from rayslice.client.cluster_set import stood_by

    rows = []
    for name, (job, url) in jobs.items():
        status = ("could not be asked" if job is UNHEARD else "no job" if job is None
                  else "stood by" if stood_by(job) else job.status.value.lower())
        label = escape(name)
        link = f'<a href="{escape(url)}">{label}</a>' if url and job not in (None, UNHEARD) and readable.get(name) \
            else label
        rows.append(f"<li>{link}: {escape(status)}</li>")
    return (f"<!doctype html><title>Ray job {escape(submission_id)}</title>"
            f"<p>Ray job {escape(submission_id)} is on every cluster of the set {escape(conn_id)}; no cluster has "
            "claimed the step yet (it waits in each one's queue), or the records do not tell which one runs it. "
            "The task's \"Ray job\" link leads to the cluster that runs it once one claims it.</p>"
            f"<ul>{''.join(rows)}</ul>")


def airflow_base(root_path: str) -> str:
    """Where the Airflow UI lives, from our mount point: `<base>/rayslice` -> `<base>`."""
    return root_path[: -len(URL_PREFIX)] if root_path.endswith(URL_PREFIX) else ""


@cache
def build_app() -> "FastAPI":
    """The plugin's FastAPI app; every route needs an Airflow user allowed to see cluster activity."""
    from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
    from airflow.api_fastapi.core_api.security import GetUserDep, requires_access_view
    from fastapi import Depends, FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
    from rayslice.plugins import slices_page
    from starlette.concurrency import run_in_threadpool

    from rayslice.client.cluster_set import ran_by

    app = FastAPI(
        title="rayslice: Slices", docs_url=None, redoc_url=None, openapi_url=None,
        dependencies=[Depends(requires_access_view(AccessView.CLUSTER_ACTIVITY))],
    )

    @app.get("/api/capacity")
    async def capacity_json(user: GetUserDep, conn_id: str = DEFAULT_CONN_ID) -> Response:
        """The capacity snapshot as JSON, plus the (credential-free) dashboard URL for job links."""
        if not await run_in_threadpool(may_choose, conn_id, user):
            return JSONResponse({"detail": NOT_YOURS}, status_code=403)
        try:
            data, dashboard = await capacity_data(conn_id, user)
        except _Problem as exc:
            return JSONResponse({"detail": str(exc)}, status_code=exc.status)
        return JSONResponse({**data, "conn_id": conn_id, "dashboard_url": dashboard},
                            headers={"Cache-Control": "no-store"})

    @app.get("/api/usage")
    async def usage_json(user: GetUserDep, conn_id: str = DEFAULT_CONN_ID, hours: float | None = None) -> Response:
        """The usage timeline's bars and lanes and the accelerator-hours tables over the last `hours`."""
        if not await run_in_threadpool(may_choose, conn_id, user):
            return JSONResponse({"detail": NOT_YOURS}, status_code=403)
        try:
            found = await read_usage(conn_id, window(hours))
        except _Problem as exc:
            return JSONResponse({"detail": str(exc)}, status_code=exc.status)
        data = await run_in_threadpool(visible_usage, found, user)
        return JSONResponse({**data, "conn_id": conn_id}, headers={"Cache-Control": "no-store"})

    @app.get("/usage", response_class=HTMLResponse)
    async def usage_fragment(request: Request, user: GetUserDep, conn_id: str = DEFAULT_CONN_ID,
                             hours: float | None = None) -> Response:
        """The usage section's HTML, which the page's script swaps in to refresh it."""
        if not await run_in_threadpool(may_choose, conn_id, user):
            return HTMLResponse(slices_page.error_box(NOT_YOURS), status_code=403)
        root = request.scope.get("root_path", "")
        body = await _usage_html(conn_id, window(hours), user, airflow_base(root))
        return HTMLResponse(body, headers={"Cache-Control": "no-store"})

    async def _usage_html(conn_id: str, hours: float, user: Any, base: str) -> str:
        try:
            found = await read_usage(conn_id, hours)
            # A set's bars are on several dashboards: none is named (its steps' "Ray job" links say where each ran).
            in_set = await run_in_threadpool(set_members, conn_id) is not None
            dashboard = "" if in_set else (await read(conn_id))[1]
        except _Problem as exc:
            return slices_page.error_box(str(exc))
        data = await run_in_threadpool(visible_usage, found, user)
        dashboard = await shown_dashboard(conn_id, user, dashboard)
        return slices_page.usage_section(data, {"airflow_base": base, "dashboard_url": dashboard})

    @app.get("/", response_class=HTMLResponse)
    async def slices(request: Request, user: GetUserDep, conn_id: str = DEFAULT_CONN_ID,
                     hours: float | None = None) -> Response:
        """The page, drawn on the server; its script then refreshes it from /api/capacity and /usage."""
        root = request.scope.get("root_path", "")
        if not await run_in_threadpool(may_choose, conn_id, user):
            body = slices_page.page(None, conn_id=DEFAULT_CONN_ID, api_url="", airflow_base=airflow_base(root),
                                    dashboard_url="", error=NOT_YOURS)
            return HTMLResponse(body, status_code=403, headers={"Cache-Control": "no-store"})
        data, dashboard, error = None, "", None
        try:
            data, dashboard = await capacity_data(conn_id, user)
        except _Problem as exc:
            error = str(exc)
        hours = window(hours)
        usage_html = await _usage_html(conn_id, hours, user, airflow_base(root)) if data else ""
        body = slices_page.page(data, conn_id=conn_id, api_url=f"{root}/api/capacity", airflow_base=airflow_base(root),
                                dashboard_url=dashboard, error=error, usage_html=usage_html, hours=hours,
                                usage_url=f"{root}/usage")
        return HTMLResponse(body, headers={"Cache-Control": "no-store"})

    @app.get("/job/{submission_id}")
    async def job(user: GetUserDep, submission_id: str, conn_id: str = DEFAULT_CONN_ID) -> Response:
        """The "Ray job" extra link: to the job's dashboard page, for users who may read the connection."""
        if not _SUBMISSION_ID.match(submission_id):
            return HTMLResponse(slices_page.error_box(f"{submission_id!r} is not a Ray submission id"),
                                status_code=400)
        if not _CONN_ID.match(conn_id) or not await run_in_threadpool(may_read_connection, conn_id, user):
            return HTMLResponse(slices_page.error_box(NO_DASHBOARD), status_code=403)
        try:
            members = await run_in_threadpool(set_members, conn_id)
            if members is not None:  # a set: each member has a job of this id; lead to the one that ran it
                return await _job_on_set(user, submission_id, conn_id, members)
            ray = await run_in_threadpool(ray_connection, conn_id)
        except _Problem as exc:
            return HTMLResponse(slices_page.error_box(str(exc)), status_code=exc.status)
        return RedirectResponse(ray.job_url(quote(submission_id, safe="")), status_code=307,
                                headers={"Cache-Control": "no-store"})

    async def _job_on_set(user: Any, submission_id: str, conn_id: str, members: tuple[str, ...]) -> Response:
        """The link of a set's step that names the set (no cluster had claimed it when the link was made): the
        member whose job ran it, by the members' job records, if the user may read that member's connection;
        else a page of each member's job (links only to members the user may read)."""
        jobs = await set_jobs(submission_id, members)
        chosen = ran_by({name: job for name, (job, _) in jobs.items() if job is not UNHEARD},
                        unknown=[name for name, (job, _) in jobs.items() if job is UNHEARD])
        readable = {name: await run_in_threadpool(may_read_connection, name, user) for name in members}
        if chosen is not None:
            if not readable[chosen]:
                return HTMLResponse(slices_page.error_box(NO_DASHBOARD), status_code=403)
            url = jobs[chosen][1]
            return RedirectResponse(url, status_code=307, headers={"Cache-Control": "no-store"})
        return HTMLResponse(set_job_page(submission_id, conn_id, jobs, readable), headers={"Cache-Control": "no-store"})

    @app.get("/icon.svg")
    async def icon() -> Response:
        return Response(_ICON, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    return app
