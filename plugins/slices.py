"""The Airflow UI's **Slices** page: the Ray cluster's TPU slices and GPU nodes, who holds them, what waits.

An Airflow 3 plugin: a FastAPI app mounted at `/rayslice` (the page, and the JSON it refreshes
from) and a nav entry that shows the page inside the UI. Importing this module is cheap: the
app (FastAPI, Airflow's API security) is built only when Airflow reads `fastapi_apps`, which
only the API server does.

Every route takes the same credentials as Airflow's own API (the UI's `_token` cookie or an
`Authorization: Bearer` JWT) and needs the "cluster activity" view; holders in DAGs the user
may not read are shown as hidden. The `ray` connection's token never leaves the server.
"""

# No `from __future__ import annotations`: FastAPI must see the route signatures' real types,
# which are imported inside build_app().
import re
import time
from functools import cache
from typing import TYPE_CHECKING, Any

from airflow.plugins_manager import AirflowPlugin

if TYPE_CHECKING:
    from fastapi import FastAPI
    from rayslice.hooks.ray import RayConnectionSettings

    from rayslice.client.capacity import Snapshot

URL_PREFIX = "/rayslice"
DEFAULT_CONN_ID = "ray_default"
CACHE_S = 2.0  # many open pages share one reading of the cluster
_CONN_ID = re.compile(r"^[\w.-]{1,250}$")
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
    from airflow.sdk import BaseHook
    from rayslice.hooks.ray import settings_from_connection

    from rayslice.core.exceptions import RaysliceError

    if not _CONN_ID.match(conn_id):
        raise _Problem(400, f"{conn_id!r} is not a connection id")
    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception as exc:  # AirflowNotFoundException, or a secrets backend error
        raise _Problem(404, f"no Airflow connection {conn_id!r} ({type(exc).__name__}); add one of type `ray` "
                            "whose host is the Ray dashboard URL, e.g. http://ray-head:8265") from None
    if (conn.conn_type or "").lower() != "ray":
        raise _Problem(400, f"connection {conn_id!r} is of type {conn.conn_type!r}, not `ray`")
    try:
        return settings_from_connection(conn)
    except RaysliceError as exc:
        raise _Problem(400, str(exc)) from None


_readings: "dict[str, tuple[float, Snapshot]]" = {}


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
        snap = await capacity.asnapshot(ray.dashboard_url, token=ray.token, verify=ray.verify, headers=ray.headers)
    except RaysliceError as exc:
        message = str(exc).replace(ray.token, "***") if ray.token else str(exc)
        raise _Problem(502, message) from None
    _readings[key] = (time.monotonic(), snap)
    return snap, ray.dashboard_url


def visible(snap: "Snapshot", user: Any) -> dict[str, Any]:
    """The snapshot as JSON, with holders in DAGs this user may not read replaced by a hidden one."""
    from airflow.api_fastapi.app import get_auth_manager

    data = snap.model_dump(mode="json")
    holders = [s["holder"] for s in data["slices"]] + [h["holder"] for s in data["slices"] for h in s["hosts"]]
    holders += [sh["holder"] for n in data["gpu_nodes"] for sh in n["shares"]]
    holders += [p["holder"] for p in data["pending"]]
    dag_ids = {h["dag_id"] for h in holders if h and h["dag_id"]}
    allowed = get_auth_manager().filter_authorized_dag_ids(dag_ids=dag_ids, user=user) if dag_ids else set()
    for holder in holders:
        if holder and holder["dag_id"] and holder["dag_id"] not in allowed:
            holder.update(submission_id="", dag_id="", run_id="", task_id="", request="", job_id=None,
                          job_status=None, name="", label="a task in a DAG you cannot read")
    return data


def airflow_base(root_path: str) -> str:
    """Where the Airflow UI lives, from our mount point: `<base>/rayslice` -> `<base>`."""
    return root_path[: -len(URL_PREFIX)] if root_path.endswith(URL_PREFIX) else ""


@cache
def build_app() -> "FastAPI":
    """The plugin's FastAPI app; every route needs an Airflow user allowed to see cluster activity."""
    from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
    from airflow.api_fastapi.core_api.security import GetUserDep, requires_access_view
    from fastapi import Depends, FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, Response
    from rayslice.plugins import slices_page
    from starlette.concurrency import run_in_threadpool

    app = FastAPI(
        title="rayslice: Slices", docs_url=None, redoc_url=None, openapi_url=None,
        dependencies=[Depends(requires_access_view(AccessView.CLUSTER_ACTIVITY))],
    )

    @app.get("/api/capacity")
    async def capacity_json(user: GetUserDep, conn_id: str = DEFAULT_CONN_ID) -> Response:
        """The capacity snapshot as JSON, plus the (credential-free) dashboard URL for job links."""
        try:
            snap, dashboard = await read(conn_id)
        except _Problem as exc:
            return JSONResponse({"detail": str(exc)}, status_code=exc.status)
        data = await run_in_threadpool(visible, snap, user)  # auth managers may ask their database
        return JSONResponse({**data, "conn_id": conn_id, "dashboard_url": dashboard},
                            headers={"Cache-Control": "no-store"})

    @app.get("/", response_class=HTMLResponse)
    async def slices(request: Request, user: GetUserDep, conn_id: str = DEFAULT_CONN_ID) -> Response:
        """The page, drawn on the server; its script then refreshes it from /api/capacity."""
        root = request.scope.get("root_path", "")
        data, dashboard, error = None, "", None
        try:
            snap, dashboard = await read(conn_id)
            data = await run_in_threadpool(visible, snap, user)
        except _Problem as exc:
            error = str(exc)
        body = slices_page.page(data, conn_id=conn_id, api_url=f"{root}/api/capacity", airflow_base=airflow_base(root),
                                dashboard_url=dashboard, error=error)
        return HTMLResponse(body, headers={"Cache-Control": "no-store"})

    @app.get("/icon.svg")
    async def icon() -> Response:
        return Response(_ICON, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    return app
