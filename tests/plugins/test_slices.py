"""The Slices UI plugin, served by Airflow's real API app over the real test cluster.

Airflow finds the plugin, mounts its FastAPI app at /rayslice, and protects every route with
its own auth: the simple auth manager's JWTs (bearer header or the UI's `_token` cookie).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid

import pytest

from tests.airflow_env import REPO

TOKEN = "ray-t0ken-never-shown"


@pytest.fixture(scope="module")
def airflow(airflow_db, ray_default, tmp_path_factory):
    """Airflow's API app with the plugin (installed the plugins-folder way) and a simple auth manager."""
    from airflow import plugins_manager, settings
    from airflow.api_fastapi import app as api_app

    folder = tmp_path_factory.mktemp("plugins")
    (folder / "rayslice_slices.py").write_text("from rayslice.plugins.slices import SlicesPlugin  # noqa: F401\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(settings, "PLUGINS_FOLDER", str(folder))
        mp.setenv("AIRFLOW__CORE__AUTH_MANAGER",
                  "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager")
        mp.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS", "False")
        mp.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS", "admin:admin,viewer:viewer")
        mp.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE", str(folder / "passwords.json"))
        mp.setenv("AIRFLOW__API_AUTH__JWT_SECRET", uuid.uuid4().hex * 2)
        # A token on the connection: the cluster ignores it, the page must never show it.
        conn = {"conn_type": "ray", "host": ray_default.dashboard_url, "password": ray_default.token or TOKEN}
        mp.setenv("AIRFLOW_CONN_RAY_DEFAULT", json.dumps(conn))
        mp.setenv("AIRFLOW_CONN_NOT_RAY", json.dumps({"conn_type": "http", "host": "http://example.com"}))
        _reset_plugins(plugins_manager, api_app)
        try:
            yield api_app.create_app("core"), ray_default
        finally:
            _reset_plugins(plugins_manager, api_app)


def _reset_plugins(plugins_manager, api_app) -> None:
    for cached in (plugins_manager._get_plugins, plugins_manager._get_ui_plugins, plugins_manager.get_fastapi_plugins):
        cached.cache_clear()
    api_app.purge_cached_app()


@pytest.fixture(scope="module")
def client(airflow):
    from fastapi.testclient import TestClient

    return TestClient(airflow[0])


def jwt(username: str, role: str | None) -> str:
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    return get_auth_manager().generate_jwt(SimpleAuthManagerUser(username=username, role=role))


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_airflow_loads_the_plugin_with_its_app_and_nav_entry(airflow):
    from airflow import plugins_manager

    [plugin] = [p for p in plugins_manager._get_plugins()[0] if p.name == "rayslice_slices"]
    [app] = plugin.fastapi_apps
    assert app["url_prefix"] == "/rayslice" and app["app"].__class__.__name__ == "FastAPI"
    [view] = plugin.external_views
    assert view["href"] == "/rayslice/" and view["url_route"] == "slices" and view["destination"] == "nav"
    assert view in plugins_manager._get_ui_plugins()[0]
    info = next(p for p in plugins_manager.get_plugin_info() if p["name"] == "rayslice_slices")
    assert info["fastapi_apps"][0]["url_prefix"] == "/rayslice"


def test_importing_the_plugin_is_cheap():
    """Every Airflow process imports plugins; only the API server should pay for FastAPI."""
    code = ("import sys; import rayslice.plugins.slices as s; "
            "print(sorted(m for m in ('fastapi', 'rayslice.client.capacity', 'airflow.api_fastapi.core_api.security') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("path", ["/rayslice/", "/rayslice/api/capacity", "/rayslice/icon.svg",
                                  "/rayslice/api/capacity?conn_id=not_ray"])
def test_anonymous_and_forged_requests_are_refused(client, path):
    assert client.get(path).status_code == 401
    assert client.get(path, headers=bearer("not-a-jwt")).status_code in (401, 403)
    assert client.get(path, cookies={"_token": "not-a-jwt"}).status_code in (401, 403)
    assert client.get(path, headers=bearer(jwt("nobody", None))).status_code == 403  # signed in, no role


def test_no_docs_or_schema_routes_bypass_auth(client):
    for path in ("/rayslice/docs", "/rayslice/openapi.json", "/rayslice/redoc"):
        assert client.get(path, headers=bearer(jwt("admin", "admin"))).status_code == 404


def test_json_is_the_snapshot(client, airflow):
    cluster = airflow[1]
    resp = client.get("/rayslice/api/capacity", headers=bearer(jwt("viewer", "viewer")))
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert [s["name"] for s in data["slices"]] == ["v6e-16-a", "v6e-16-b", "v6e-4-a"]
    assert [len(s["hosts"]) for s in data["slices"]] == [4, 4, 1]
    assert [n["total"] for n in data["gpu_nodes"]] == [3]
    assert {"pending", "taken_at", "warnings"} <= set(data)
    assert data["dashboard_url"] == cluster.dashboard_url and data["conn_id"] == "ray_default"
    assert (cluster.token or TOKEN) not in resp.text and resp.headers["cache-control"] == "no-store"


def test_page_draws_the_slices_with_the_ui_cookie(client, airflow):
    resp = client.get("/rayslice/", cookies={"_token": jwt("viewer", "viewer")})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    page, script = resp.text.split('<script id="config"')
    for name in ("v6e-16-a", "v6e-16-b", "v6e-4-a"):
        assert f"<h3>{name}</h3>" in page
    assert page.count('class="host ') == 9 and page.count('<i class="chip"></i>') == 36
    assert "GPU node" in page and '"api": "/rayslice/api/capacity"' in script
    assert (airflow[1].token or TOKEN) not in resp.text
    assert "<script src" not in resp.text and "<link" not in resp.text  # no external assets: the machine may be offline


def test_connection_problems_are_explained_not_leaked(client):
    headers = bearer(jwt("admin", "admin"))
    wrong = client.get("/rayslice/api/capacity?conn_id=not_ray", headers=headers)
    assert wrong.status_code == 400 and "not `ray`" in wrong.json()["detail"]
    missing = client.get("/rayslice/api/capacity?conn_id=nope", headers=headers)
    assert missing.status_code == 404 and "add one of type `ray`" in missing.json()["detail"]
    page = client.get("/rayslice/?conn_id=nope", headers=headers)
    assert page.status_code == 200 and "add one of type `ray`" in page.text


def test_holders_of_unreadable_dags_are_hidden(client, monkeypatch):
    from airflow.api_fastapi.app import get_auth_manager
    from rayslice.plugins import slices

    from rayslice.client.capacity import Holder, Slice, Snapshot

    holder = Holder(submission_id="s1", dag_id="secret_dag", run_id="r", task_id="t", job_status="RUNNING")
    snap = Snapshot(slices=[Slice(name="x", pod_type="v6e-4", topology="2x2", hosts=[], chips=4, state="reserved",
                                  holder=holder)], gpu_nodes=[], pending=[], taken_at="2026-01-01T00:00:00Z")
    monkeypatch.setattr(get_auth_manager(), "filter_authorized_dag_ids", lambda *, dag_ids, user, **kw: set())
    data = slices.visible(snap, user=None)
    assert "secret_dag" not in json.dumps(data)
    assert data["slices"][0]["holder"]["label"] == "a task in a DAG you cannot read"


def _rich_snapshot() -> dict:
    """Every shape the page draws: running, reserved, partial and free slices, shares, waits, odd names."""
    from rayslice.client.capacity import GpuNode, GpuShare, Holder, Host, Pending, Slice, Snapshot

    task = Holder(submission_id="rayslice-d-t-1", dag_id="d <&> 'x'", run_id="manual__2026-01-01T00:00:00+00:00",
                  task_id="train(1)!", map_index=3, request="v6e-16", job_id="05000000", job_status="RUNNING")
    driver = Holder(submission_id="test-1", job_id="06000000")
    foreign = Holder(name="someone's actor", job_id="07000000")
    hosts = [Host(worker_id=i, node_id=f"n{i}" * 8, chips=4, chips_used=4, state=state, holder=task)
             for i, state in enumerate(("running", "running", "reserved", "running"))]
    return Snapshot(
        slices=[Slice(name="v6e-16-a", pod_type="v6e-16", topology="4x4", hosts=hosts, chips=16, state="running",
                      holder=task),
                Slice(name="v6e-8-a", pod_type="v6e-8", topology="2x4", chips=8, state="partial", holder=driver,
                      hosts=[Host(worker_id=0, node_id="m" * 20, chips=8, state="reserved", holder=driver)]),
                Slice(name="v6e-1-a", pod_type="v6e-1", topology="1x1", chips=1, state="free",
                      hosts=[Host(worker_id=0, node_id="k" * 20, chips=1)])],
        gpu_nodes=[GpuNode(node_id="g" * 40, total=3, used=0.75, shares=[
            GpuShare(holder=task, amount=0.25, gpus=[0]), GpuShare(holder=foreign, amount=0.5, state="reserved")]),
            GpuNode(node_id="h" * 40, total=1, used=0, shares=[])],
        pending=[Pending(kind="placement_group", request="v6e-16", resources={"TPU": 16}, holder=task,
                         since="2026-01-01T00:00:00Z", waiting_s=3725.5),
                 Pending(kind="actor", request="GPU x0.25", resources={"GPU": 0.25}, holder=driver, starting=True),
                 Pending(kind="actor", request="NPU x1", resources={"NPU": 1}, holder=foreign)],
        taken_at="2026-01-01T01:02:05Z", warnings=["actors: only 10000 of 12000 listed"],
    ).model_dump(mode="json")


@pytest.mark.skipif(not shutil.which("node"), reason="needs node to run the page's script")
@pytest.mark.parametrize("error", [None, "Could not refresh: HTTP 502"])
def test_the_script_redraws_exactly_what_the_server_drew(client, error):
    """slices.js re-renders the page from JSON; it must draw the same markup as slices_page.fleet()."""
    from rayslice.plugins import slices_page

    live = client.get("/rayslice/api/capacity", headers=bearer(jwt("viewer", "viewer"))).json()
    harness = ("const {fleet} = require(process.argv[1]); let s = ''; process.stdin.on('data', (d) => s += d)"
               ".on('end', () => { const [d, ctx, e] = JSON.parse(s); process.stdout.write(fleet(d, ctx, e)); });")
    for data in (_rich_snapshot(), live, None):
        ctx = {"airflow_base": "/base", "dashboard_url": "http://ray:8265"}
        js_ctx = {"airflowBase": ctx["airflow_base"], "dashboardUrl": ctx["dashboard_url"]}
        out = subprocess.run(["node", "-e", harness, str(slices_page.STATIC / "slices.js")], capture_output=True,
                             text=True, input=json.dumps([data, js_ctx, error]), timeout=60, check=True)
        assert out.stdout == slices_page.fleet(data, ctx, error)


def test_page_links_to_the_task_instance_and_the_ray_job():
    from rayslice.plugins import slices_page

    html = slices_page.fleet(_rich_snapshot(), {"airflow_base": "/base", "dashboard_url": "http://ray:8265"})
    assert ('href="/base/dags/d%20%3C%26%3E%20&#x27;x&#x27;/runs/manual__2026-01-01T00%3A00%3A00%2B00%3A00'
            '/tasks/train(1)!/mapped/3"') in html
    assert 'href="http://ray:8265/#/jobs/rayslice-d-t-1"' in html
    assert 'href="http://ray:8265/#/jobs/06000000"' in html and "test-1" in html  # a plain driver: by job id
    assert "d &lt;&amp;&gt; &#x27;x&#x27;" in html and "<&>" not in html
    assert "1h 02m" in html and ">starting<" in html
    assert html.count("on GPU 0</span>") == 1 and html.count("gpu-index") == 1  # the unknown one says nothing
