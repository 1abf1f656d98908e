"""The Slices UI plugin, served by Airflow's real API app over the real test cluster.

Airflow finds the plugin, mounts its FastAPI app at /rayslice, and protects every route with
its own auth: the simple auth manager's JWTs (bearer header or the UI's `_token` cookie).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.airflow_env import REPO
from tests.plugins.conftest import plugin_app

TOKEN = "ray-t0ken-never-shown"


@pytest.fixture(scope="module")
def airflow(airflow_db, ray_default, tmp_path_factory):
    """Airflow's API app with the plugin (installed the plugins-folder way) and a simple auth manager."""
    folder = tmp_path_factory.mktemp("plugins")
    # A token on the connection: the cluster ignores it, the page must never show it.
    conn = {"conn_type": "ray", "host": ray_default.dashboard_url, "password": ray_default.token or TOKEN}
    with plugin_app(folder, "admin:admin,viewer:viewer,op:op",
                    {"ray_default": conn, "not_ray": {"conn_type": "http", "host": "http://example.com"}}) as app:
        yield app, ray_default


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
                                  "/rayslice/api/capacity?conn_id=not_ray", "/rayslice/api/usage", "/rayslice/usage",
                                  "/rayslice/job/rayslice-d-t-1"])
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
    assert data["dashboard_url"] == "" and data["conn_id"] == "ray_default"  # a viewer may not read connections
    assert cluster.dashboard_url not in resp.text
    assert (cluster.token or TOKEN) not in resp.text and resp.headers["cache-control"] == "no-store"
    reader = client.get("/rayslice/api/capacity", headers=bearer(jwt("op", "op")))
    assert reader.json()["dashboard_url"] == cluster.dashboard_url


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


def test_the_dashboard_url_is_shown_only_to_users_who_may_read_the_connection(client, airflow):
    """The page's dashboard link, its job links and the usage section: none for a viewer, all for an op."""
    cluster = airflow[1]
    for path in ("/rayslice/", "/rayslice/usage", "/rayslice/api/capacity"):
        viewer = client.get(path, headers=bearer(jwt("viewer", "viewer")))
        op = client.get(path, headers=bearer(jwt("op", "op")))
        assert viewer.status_code == op.status_code == 200, (viewer.text[:300], op.text[:300])
        assert cluster.dashboard_url not in viewer.text, path
        assert cluster.dashboard_url in op.text or path == "/rayslice/usage", path  # no bars: no job links
    assert "Ray dashboard" in client.get("/rayslice/", headers=bearer(jwt("op", "op"))).text


def test_the_ray_job_link_redirects_only_connection_readers(client, airflow):
    cluster = airflow[1]
    path = "/rayslice/job/rayslice-d-t-1"
    op = client.get(path, headers=bearer(jwt("op", "op")), follow_redirects=False)
    assert op.status_code == 307 and op.headers["location"] == f"{cluster.dashboard_url}/#/jobs/rayslice-d-t-1"
    viewer = client.get(path, headers=bearer(jwt("viewer", "viewer")), follow_redirects=False)
    assert viewer.status_code == 403 and "location" not in viewer.headers
    assert cluster.dashboard_url not in viewer.text and "only users allowed to read the task" in viewer.text
    for conn in ("nope", "not_ray"):  # a viewer learns nothing about other connections either
        other = client.get(f"{path}?conn_id={conn}", headers=bearer(jwt("viewer", "viewer")), follow_redirects=False)
        assert other.status_code == 403 and other.text == viewer.text
    assert client.get(f"{path}?conn_id=nope", headers=bearer(jwt("op", "op"))).status_code == 404
    assert client.get("/rayslice/job/a%20b", headers=bearer(jwt("op", "op"))).status_code == 400
    assert client.get(path).status_code == 401


def test_connection_problems_are_explained_not_leaked(client):
    headers = bearer(jwt("admin", "admin"))
    wrong = client.get("/rayslice/api/capacity?conn_id=not_ray", headers=headers)
    assert wrong.status_code == 400 and "not `ray`" in wrong.json()["detail"]
    missing = client.get("/rayslice/api/capacity?conn_id=nope", headers=headers)
    assert missing.status_code == 404 and "add one of type `ray`" in missing.json()["detail"]
    page = client.get("/rayslice/?conn_id=nope", headers=headers)
    assert page.status_code == 200 and "add one of type `ray`" in page.text


@pytest.mark.parametrize("path", ["/rayslice/api/capacity", "/rayslice/api/usage", "/rayslice/usage", "/rayslice/"])
def test_only_users_who_may_read_connections_choose_the_connection(client, path):
    """A viewer cannot tell an existing non-`ray` connection from a missing one: the same refusal for both."""
    viewer = bearer(jwt("viewer", "viewer"))
    answers = {conn: client.get(f"{path}?conn_id={conn}", headers=viewer)
               for conn in ("not_ray", "nope", "ray_default2", "bad%20id!")}
    assert {conn: r.status_code for conn, r in answers.items()} == dict.fromkeys(answers, 403)
    assert len({r.text for r in answers.values()}) == 1, {c: r.text[:200] for c, r in answers.items()}
    assert "not_ray" not in answers["not_ray"].text and "http" not in answers["not_ray"].text.split("<style>")[0]
    assert "read Airflow connections" in answers["nope"].text
    assert client.get(f"{path}?conn_id=ray_default", headers=viewer).status_code == 200  # the default is everyone's
    assert client.get(path, headers=viewer).status_code == 200
    # A user who may read connections still gets the explanation (what is wrong with which connection).
    op = bearer(jwt("op", "op"))
    if path.startswith("/rayslice/api/"):
        wrong, missing = (client.get(f"{path}?conn_id={c}", headers=op) for c in ("not_ray", "nope"))
        assert (wrong.status_code, missing.status_code) == (400, 404), (wrong.text, missing.text)
        assert "not `ray`" in wrong.json()["detail"] and "add one of type `ray`" in missing.json()["detail"]


def test_usage_json_and_the_page_section(client, airflow):
    viewer = bearer(jwt("viewer", "viewer"))
    resp = client.get("/rayslice/api/usage?hours=1", headers=viewer)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["hours"] == 1 and {"bars", "lanes", "by_dag", "by_task", "since", "until", "oldest"} <= set(data)
    assert [(lane["key"], lane["kind"]) for lane in data["lanes"]][:3] == [
        ("v6e-16-a", "tpu"), ("v6e-16-b", "tpu"), ("v6e-4-a", "tpu")]
    assert [lane["kind"] for lane in data["lanes"]][3:] == ["gpu"]
    assert client.get("/rayslice/api/usage?hours=5", headers=viewer).json()["hours"] == 6  # not offered: default
    page = client.get("/rayslice/?hours=3", headers=viewer).text
    assert '<section id="usage">' in page and 'class="timeline"' in page and "By DAG" in page
    assert '<option value="3" selected>' in page and '"usage": "/rayslice/usage"' in page
    fragment = client.get("/rayslice/usage?hours=3", headers=viewer)
    assert fragment.status_code == 200 and fragment.text.startswith('<div class="timeline">')
    assert (airflow[1].token or TOKEN) not in page + fragment.text


def test_usage_of_unreadable_dags_is_counted_without_names(client, monkeypatch):
    from airflow.api_fastapi.app import get_auth_manager
    from rayslice.plugins import slices, slices_page

    from rayslice.client.usage import Bar, Lane, Usage

    def bar(dag: str, task: str, hours: float, kind: str = "tpu") -> Bar:
        return Bar(lane="v6e-4-a", kind=kind, submission_id=f"rayslice-{dag}-{task}", dag_id=dag, run_id="r",
                   task_id=task, request="v6e-4", start="2026-01-01T00:00:00Z", end="2026-01-01T01:00:00Z",
                   amount=4, hours=hours, job_id="02000000", job_status="SUCCEEDED")

    found = Usage(since="2026-01-01T00:00:00Z", until="2026-01-01T06:00:00Z", hours=6,
                  lanes=[Lane(key="v6e-4-a", kind="tpu", title="v6e-4-a")],
                  bars=[bar("open_dag", "train", 4), bar("secret_dag", "train_secret", 2),
                        bar("secret_dag", "eval_secret", 0.5, "gpu")])
    figures = {"seconds": {}, "chip_s": {"productive": 3600.0, "startup": 3600.0 * 3}, "held_chip_s": 3600.0 * 4,
               "attempts": 1}
    found.goodput = {"rayslice-open_dag-train": figures, "rayslice-secret_dag-train_secret": figures}
    monkeypatch.setattr(get_auth_manager(), "filter_authorized_dag_ids",
                        lambda *, dag_ids, user, **kw: {d for d in dag_ids if d == "open_dag"})
    data = slices.visible_usage(found, user=None)
    text = json.dumps(data) + slices_page.usage_section(data, {"airflow_base": "", "dashboard_url": "http://r:1"})
    assert "secret" not in text
    assert [(r["dag_id"], r["hidden"], r["steps"], r["tpu_chip_hours"], r["gpu_hours"]) for r in data["by_dag"]] == [
        ("open_dag", False, 1, 4, 0), ("", True, 2, 2, 0.5)]  # the bill still adds up
    # Goodput per DAG and task, hidden steps' under their hidden ids; a row without figures shows "-", never 0.
    assert [(r["goodput"], r["measured"]) for r in data["by_dag"]] == [(0.25, 1), (0.25, 1)]
    assert sorted(data["goodput"]) == ["hidden-1", "rayslice-open_dag-train"]
    assert '<td class="num goodput" title="startup 3 chip-h; productive 1 chip-h">25.0%</td>' in text
    assert "25.0% (1 of 2 steps)" in text and '<th class="num" title="productive chip-time' in text
    assert "a task in a DAG you cannot read" in text and "DAGs you cannot read" in text


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
                      holder=task, since="2026-01-01T00:59:30Z", held_s=155),
                Slice(name="v6e-8-a", pod_type="v6e-8", topology="2x4", chips=8, state="partial", holder=driver,
                      hosts=[Host(worker_id=0, node_id="m" * 20, chips=8, state="reserved", holder=driver)]),
                Slice(name="v6e-1-a", pod_type="v6e-1", topology="1x1", chips=1, state="free",
                      hosts=[Host(worker_id=0, node_id="k" * 20, chips=1)])],
        gpu_nodes=[GpuNode(node_id="g" * 40, total=3, used=0.75, shares=[
            GpuShare(holder=task, amount=0.25, gpus=[0], since="2026-01-01T01:02:00Z", held_s=5),
            GpuShare(holder=foreign, amount=0.5, state="reserved")]),
            GpuNode(node_id="h" * 40, total=1, used=0, shares=[])],
        pending=[Pending(kind="placement_group", request="v6e-16", resources={"TPU": 16}, holder=task,
                         since="2026-01-01T00:00:00Z", waiting_s=3725.5),
                 Pending(kind="actor", request="GPU x0.25", resources={"GPU": 0.25}, holder=driver, starting=True),
                 Pending(kind="actor", request="NPU x1", resources={"NPU": 1}, holder=foreign),
                 Pending(kind="queue", request="v6e-16 x2", resources={}, holder=task, waiting_s=40, priority=5,
                         team="<b>research</b>", place=2)],
        taken_at="2026-01-01T01:02:05Z", warnings=["actors: only 10000 of 12000 listed"],
    ).model_dump(mode="json")


def _rich_set() -> dict:
    """A cluster set's reading: a member with every shape, one unreachable, a step waiting on both, one running on
    one and standing by on the other, and demand only one member knows."""
    from rayslice.client.capacity import Holder, Pending, Snapshot
    from rayslice.client.set_capacity import Across, MemberCapacity, SetSnapshot

    rich = Snapshot.model_validate(_rich_snapshot())
    both = Holder(submission_id="rayslice-s-1", dag_id="d", run_id="r", task_id="t<1>", job_id="08000000",
                  job_status="RUNNING", cluster_set="tpus")
    waiting = Pending(kind="queue", request="v6e-4", resources={}, holder=both, waiting_s=12, priority=1)
    data = SetSnapshot(name="tpus", members=[
        MemberCapacity(name="set-a", snapshot=rich), MemberCapacity(name="set-b", error="<b>refused</b>"),
        MemberCapacity(name="set-c", snapshot=rich.model_copy(update={"pending": []}))],
        queue=[Across(demand=waiting, waits_on=["set-a", "set-c"], places={"set-a": 2}),
               Across(demand=rich.pending[1], waits_on=["set-a"]),
               Across(demand=rich.pending[3], runs_on="set-c", stands_by=["set-a"])],
        taken_at="2026-01-01T01:02:05Z").model_dump(mode="json")
    for member, url in zip(data["members"], ("http://a:8265", "", ""), strict=True):
        member["dashboard_url"] = url
    return data


@pytest.mark.skipif(not shutil.which("node"), reason="needs node to run the page's script")
@pytest.mark.parametrize("error", [None, "Could not refresh: HTTP 502"])
def test_the_script_redraws_exactly_what_the_server_drew(client, error):
    """slices.js re-renders the page from JSON; it must draw the same markup as slices_page.fleet()."""
    from rayslice.plugins import slices_page

    live = client.get("/rayslice/api/capacity", headers=bearer(jwt("viewer", "viewer"))).json()
    harness = ("const {fleet} = require(process.argv[1]); let s = ''; process.stdin.on('data', (d) => s += d)"
               ".on('end', () => { const [d, ctx, e] = JSON.parse(s); process.stdout.write(fleet(d, ctx, e)); });")
    for data in (_rich_snapshot(), _rich_set(), live, None):
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
    assert 'since 00:59:30 UTC &#183; <span class="held">2m 35s</span>' in html  # a held slice: since when
    assert html.count("on GPU 0</span>") == 1 and html.count("gpu-index") == 1  # the unknown one says nothing
    assert "2nd in line, priority 5, team &lt;b&gt;research&lt;/b&gt;" in html  # its place in the queue, as text


# Names any code on the cluster can set: an actor's name, a Ray job's metadata.
_IMG = "<img src=x onerror=window.__pwned=1>"
_SVG = "<svg onload=window.__pwned=1>"


def _hostile_usage() -> dict:
    from rayslice.client.usage import Bar, Lane, Usage

    bars = [Bar(lane="v6e-4-a", kind="tpu", submission_id=_IMG, dag_id=_SVG, run_id=_IMG, task_id=_IMG,
                request=_SVG, start="2026-01-01T00:00:00Z", end="2026-01-01T01:00:00Z", amount=4, hours=4,
                job_id="02000000", job_status="SUCCEEDED")]
    return Usage(since="2026-01-01T00:00:00Z", until="2026-01-01T06:00:00Z", hours=6,
                 lanes=[Lane(key="v6e-4-a", kind="tpu", title=_IMG, detail=_SVG)], bars=bars).model_dump(mode="json")


def test_names_from_ray_are_text_in_every_part_of_the_page():
    """A DAG id from a job's metadata and a submission id from an actor's name never become markup."""
    from rayslice.plugins import slices_page

    from rayslice.client import usage

    data = _hostile_usage()
    by_dag, by_task = usage.totals([usage.Bar.model_validate(b) for b in data["bars"]])
    data |= {"by_dag": [r.model_dump(mode="json") for r in by_dag], "by_task": [r.model_dump(mode="json")
                                                                                  for r in by_task]}
    html = slices_page.usage_section(data, {"airflow_base": "", "dashboard_url": "http://r:1"})
    assert "<img" not in html and "<svg onload" not in html, html
    assert "&lt;svg onload=window.__pwned=1&gt;" in html  # shown, as text
    page = slices_page.page(None, conn_id="ray_default", api_url="/x", airflow_base="", dashboard_url=f"http://{_IMG}",
                            error=_SVG, usage_html="")
    assert "<img" not in page.split("<script>")[0].replace('<script id="config"', "")
    config = page.split('<script id="config" type="application/json">')[1].split("</script>")[0]
    assert "<" not in config and json.loads(config)["dashboardUrl"] == f"http://{_IMG}"


def test_what_no_readable_dag_owns_is_hidden(client, monkeypatch):
    """A bar whose job record was deleted has no DAG: its submission id (which spells DAG and task) is not shown.

    The same for live holders, waiting requests, map index and try number of DAGs the viewer may not read.
    """
    from airflow.api_fastapi.app import get_auth_manager
    from rayslice.plugins import slices, slices_page

    from rayslice.client.capacity import Holder, Pending, Slice, Snapshot
    from rayslice.client.usage import Bar, Lane, Usage

    deleted = Bar(lane="v6e-4-a", kind="tpu", submission_id="rayslice-secret_dag-train-7-abc",
                  start="2026-01-01T00:00:00Z", end="2026-01-01T01:00:00Z", amount=4, hours=4)
    mapped = Bar(lane="v6e-4-a", kind="tpu", submission_id="rayslice-x", dag_id="secret_dag", run_id="r",
                 task_id="t", map_index=5, try_number=3, request="v6e-4", start="2026-01-01T02:00:00Z", amount=4,
                 hours=1)
    found = Usage(since="2026-01-01T00:00:00Z", until="2026-01-01T06:00:00Z", hours=6,
                  lanes=[Lane(key="v6e-4-a", kind="tpu", title="v6e-4-a")], bars=[deleted, mapped])
    secret = Holder(submission_id="rayslice-secret_dag-train", dag_id="secret_dag", run_id="r", task_id="t",
                    map_index=5, try_number=3, request="v6e-16", job_status="RUNNING")
    nameless = Holder(submission_id="rayslice-secret_dag-old-1")  # its job record is gone
    snap = Snapshot(slices=[Slice(name="x", pod_type="v6e-4", topology="2x2", hosts=[], chips=4, state="reserved",
                                  holder=nameless)], gpu_nodes=[],
                    pending=[Pending(kind="placement_group", request="v6e-16", resources={"TPU-v6e-16-head": 1},
                                     holder=secret)], taken_at="2026-01-01T00:00:00Z")
    monkeypatch.setattr(get_auth_manager(), "filter_authorized_dag_ids",
                        lambda *, dag_ids, user, **kw: set(dag_ids) - {"secret_dag"})
    used = slices.visible_usage(found, user=None)
    live = slices.visible(snap, user=None)
    ctx = {"airflow_base": "", "dashboard_url": "http://r:1"}
    text = json.dumps([used, live]) + slices_page.usage_section(used, ctx) + slices_page.fleet(live, ctx)
    assert "secret" not in text and "v6e-16" not in text, text
    assert all(b["hidden"] and b["map_index"] == -1 and b["try_number"] == 0 for b in used["bars"]), used["bars"]
    assert [(r["hidden"], r["steps"], r["tpu_chip_hours"]) for r in used["by_dag"]] == [(True, 2, 5)]
    [pending] = live["pending"]
    assert (pending["holder"]["map_index"], pending["holder"]["try_number"]) == (-1, 0), pending
    assert live["slices"][0]["holder"]["label"] == "a task in a DAG you cannot read"


def test_error_summaries_never_show_the_connections_headers(client, monkeypatch):
    """A proxy that echoes the request's headers in its error page: none of their values reaches the page."""
    import http.server
    import threading

    class Echo(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = "proxy error; you sent: " + "; ".join(f"{k}={v}" for k, v in self.headers.items())
            self.send_response(500)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        headers = {"X-Api-Key": "k3y-never-shown", "Proxy-Authorization": "Basic cHJveHk6c2VjcmV0"}
        conn = {"conn_type": "ray", "host": f"http://127.0.0.1:{server.server_port}", "password": TOKEN,
                "extra": json.dumps({"headers": headers})}
        monkeypatch.setenv("AIRFLOW_CONN_RAY_ECHO", json.dumps(conn))
        admin = bearer(jwt("admin", "admin"))
        answers = [client.get(f"/rayslice/{p}?conn_id=ray_echo", headers=admin)
                   for p in ("api/capacity", "api/usage", "usage", "")]
    finally:
        server.shutdown()
    assert answers[0].status_code == 502 and "HTTP 500" in answers[0].json()["detail"], answers[0].text
    for resp in answers:
        assert "proxy error" in resp.text, resp.text[:500]
        assert "k3y-never-shown" not in resp.text and "cHJveHk6c2VjcmV0" not in resp.text and TOKEN not in resp.text


def test_pages_whose_cache_missed_together_share_one_reading(client, monkeypatch):
    """Five pages refreshing at once cost the dashboard one capacity reading and one usage reading."""
    import asyncio

    from rayslice.plugins import slices

    from rayslice.client import capacity, usage

    calls: list[str] = []
    for module, name in ((capacity, "asnapshot"), (usage, "ausage")):
        real = getattr(module, name)

        async def counting(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return await _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
    monkeypatch.setattr(slices, "_readings", {})
    monkeypatch.setattr(slices, "_usages", {})

    async def pages():
        return await asyncio.gather(*(slices.read("ray_default") for _ in range(5)),
                                    *(slices.read_usage("ray_default", 1) for _ in range(5)))

    answers = asyncio.run(pages())
    assert sorted(calls) == ["asnapshot", "ausage"], calls
    assert len({id(snap) for snap, _ in answers[:5]}) == 1 and len({id(u) for u in answers[5:]}) == 1


def test_a_cluster_set_shows_every_member_labelled_and_the_queue_across_them_once(client, monkeypatch):
    """`?conn_id=<set>`: each member's capacity under its name (its dashboard only for readers of that member's
    connection), an unreachable member in a line that says why, and a step waiting on both members once.
    Before: the page refused a set ("this needs one cluster")."""
    from rayslice.plugins import slices

    from tests.rayslice.client.test_set_capacity import Dashboard, holding, job, queued

    a_jobs = [job("s-wait", "01000000", "train", member="set_a"), job("s-run", "03000000", "run", member="set_a")]
    b_jobs = [job("s-wait", "05000000", "train", member="set_b"), job("s-run", "07000000", "run", member="set_b")]
    monkeypatch.setattr(slices, "_set_readings", {})
    with (Dashboard("a", [queued("s-wait", "01000000"), queued("s-run", "03000000")], a_jobs) as a,
          Dashboard("b", [queued("s-wait", "05000000"), holding("s-run", "07000000", "b-host0")], b_jobs) as b):
        for name, url in (("SET_A", a.url), ("SET_B", b.url), ("SET_DEAD", "http://127.0.0.1:9")):
            monkeypatch.setenv(f"AIRFLOW_CONN_{name}", json.dumps({"conn_type": "ray", "host": url}))
        monkeypatch.setenv("AIRFLOW_CONN_TPUS", json.dumps(
            {"conn_type": "ray", "extra": json.dumps({"clusters": ["set_a", "set_b", "set_dead", "nope"]})}))
        op, viewer = bearer(jwt("op", "op")), bearer(jwt("viewer", "viewer"))
        answer = client.get("/rayslice/api/capacity?conn_id=tpus", headers=op)
        page = client.get("/rayslice/?conn_id=tpus", headers=op)
        refused = client.get("/rayslice/api/capacity?conn_id=tpus", headers=viewer)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    assert [(m["name"], m["snapshot"] is not None) for m in data["members"]] == [
        ("set_a", True), ("set_b", True), ("set_dead", False), ("nope", False)]
    assert [m["dashboard_url"] for m in data["members"][:2]] == [a.url, b.url]
    assert "127.0.0.1:9" in data["members"][2]["error"] and "add one of type `ray`" in data["members"][3]["error"]
    rows = [(r["demand"]["holder"]["task_id"], r["waits_on"], r["runs_on"], r["stands_by"]) for r in data["queue"]]
    assert rows == [("train", ["set_a", "set_b"], None, []), ("run", [], "set_b", ["set_a"])], rows
    text = page.text.split('<script id="config"')[0]
    assert page.status_code == 200 and "<h3>v6e-4-a</h3>" in text and "<h3>v6e-4-b</h3>" in text
    assert 'Cluster <code>set_a</code>' in text and "cluster set_dead: unreachable (" in text
    assert "waits on set_a (1st in line), set_b (1st in line)" in text and "runs on set_b; stands by on set_a" in text
    assert text.count("<b>train</b>") == 1 and TOKEN not in page.text
    assert refused.status_code == 403 and refused.json()["detail"] == slices.NOT_YOURS  # choosing the set: the check


def test_a_set_members_dashboard_is_shown_only_to_readers_of_that_member(client, monkeypatch):
    """The auth rule per member: a user who may read the set's connection but not a member's sees that member's
    capacity without its dashboard URL, even in why it could not be read."""
    from airflow.api_fastapi.app import get_auth_manager
    from rayslice.plugins import slices

    from tests.rayslice.client.test_set_capacity import Dashboard

    real = get_auth_manager().is_authorized_connection

    def not_set_b(*, method, details, user, **kw):
        return details.conn_id != "set_b" and real(method=method, details=details, user=user, **kw)

    monkeypatch.setattr(get_auth_manager(), "is_authorized_connection", not_set_b)
    monkeypatch.setattr(slices, "_set_readings", {})
    with Dashboard("a", [], []) as a, Dashboard("b", [], []) as b:
        monkeypatch.setenv("AIRFLOW_CONN_SET_A", json.dumps({"conn_type": "ray", "host": a.url}))
        monkeypatch.setenv("AIRFLOW_CONN_SET_B", json.dumps({"conn_type": "ray", "host": b.url}))
        monkeypatch.setenv("AIRFLOW_CONN_TPUS", json.dumps(
            {"conn_type": "ray", "extra": json.dumps({"clusters": ["set_a", "set_b"]})}))
        up = client.get("/rayslice/api/capacity?conn_id=tpus", headers=bearer(jwt("op", "op")))
        b_url = b.url
    assert up.status_code == 200, up.text
    assert [m["dashboard_url"] for m in up.json()["members"]] == [a.url, ""] and b_url not in up.text
    monkeypatch.setattr(slices, "_set_readings", {})
    monkeypatch.setattr(slices, "_readings", {})
    down = client.get("/rayslice/?conn_id=tpus", headers=bearer(jwt("op", "op")))  # both dashboards gone now
    assert "cluster set_b: unreachable (" in down.text and b_url not in down.text, down.text[:3000]
    assert "cluster set_b&#x27;s dashboard" in down.text and a.url in down.text


def test_a_sets_holders_and_queue_of_unreadable_dags_are_hidden(client, monkeypatch):
    """Every member's holders and each row of the queue across them, as a single cluster's are hidden."""
    from airflow.api_fastapi.app import get_auth_manager
    from rayslice.plugins import slices, slices_page

    from rayslice.client.set_capacity import SetSnapshot

    found = SetSnapshot.model_validate({k: v for k, v in _rich_set().items()})
    monkeypatch.setattr(get_auth_manager(), "filter_authorized_dag_ids", lambda *, dag_ids, user, **kw: set())
    data = slices.visible_set(found, user=None)
    for member in data["members"]:
        member["dashboard_url"] = "http://r:1"
    text = json.dumps(data) + slices_page.fleet(data, {"airflow_base": "", "dashboard_url": ""})
    assert "train(1)" not in text and "t&lt;1&gt;" not in text and "rayslice-s-1" not in text, text
    assert "research" not in text and "tpus" not in json.dumps(data["queue"]), data["queue"]
    assert [row["demand"]["request"] for row in data["queue"]] == ["hidden"] * 3
    assert [where for where in (slices_page.where(r) for r in data["queue"])] == [
        "waits on set-a (2nd in line), set-c", "waits on set-a", "runs on set-c; stands by on set-a"]
