"""The Slices page in a real browser while real steps hold capacity, and nothing left behind afterwards.

Four real Ray jobs submitted through rayslice hold a v6e-16 slice, the v6e-4 slice and two
quarter GPUs until the test drops a flag file. Each step process writes down where Ray put
it (`TPU_NAME`, `CUDA_VISIBLE_DEVICES`, its pid): that is the truth the page is checked
against. Headless Chromium, logged in to the e2e package's real Airflow (`AirflowStack`, admin/admin), reads
the page inside Airflow's UI (`/plugin/slices`) and on its own (`/rayslice/`); an anonymous
client must be refused. After release, every chip and share must be free, no job running,
and every process of our jobs (drivers and step processes) gone; the Airflow's own are
checked when it stops (tests/e2e/conftest.py).

"Exactly" needs a quiet cluster: on the shared `dev` cluster the test first waits for idle.
Every wait is for a condition with a generous deadline (loaded two-core machines).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from rayslice.client import capacity
from rayslice.client.jobs_client import AsyncRayJobsClient
from rayslice.client.submission import submit_step
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local.airflow_stack import AirflowStack
from rayslice.local.processes import alive
from tests.conftest import TOTAL_TPU_CHIPS, wait_until
from tests.e2e.conftest import ARTIFACTS, browser_page, needs_chromium

DAG = "slices_page_e2e"
STEPS = {"train_16": TpuSliceRequest(tpu="v6e-16"), "train_4": TpuSliceRequest(tpu="v6e-4"),
         "eval_a": AcceleratorRequest(resource="GPU", count=0.25),
         "eval_b": AcceleratorRequest(resource="GPU", count=0.25)}
SLICE_STEPS, GPU_STEPS = ("train_16", "train_4"), ("eval_a", "eval_b")
HOLD_LIMIT_S = 420  # a step ends on its own even if the test dies without dropping the flag

pytestmark = needs_chromium

# What a person sees, read from the DOM: cards, their state pills, host squares, holders, tiles.
_READ_PAGE = """() => {
  const text = (el, sel) => { const e = el.querySelector(sel); return e ? e.textContent : null; };
  // Without "since 01:02:03 UTC · 1m 05s": it ticks, and two reads a few seconds apart must compare equal.
  const bare = (e) => { if (!e) return null; const c = e.cloneNode(true);
    c.querySelectorAll(".since").forEach((s) => s.remove()); return c.textContent; };
  return {
    error: text(document, "#fleet .error"),
    tiles: Object.fromEntries([...document.querySelectorAll(".tile")].map(
      (t) => [t.querySelector("span").textContent, t.querySelector("b").textContent])),
    slices: [...document.querySelectorAll("article.slice")].map((a) => ({
      name: text(a, "h3"), state: text(a, ".pill"), meta: text(a, ".meta"),
      hosts: [...a.querySelectorAll(".host")].map((h) => h.className.replace("host ", "")),
      task: text(a, ".holder a.task"), run: text(a, ".holder .run"), job: text(a, ".holder a.job"),
      holder: bare(a.querySelector(".holder")), since: !!a.querySelector(".holder .since .held")})),
    gpus: [...document.querySelectorAll("article.gpu")].map((a) => ({
      pill: text(a, ".pill"), meta: text(a, ".meta"), segments: a.querySelectorAll(".bar .share").length,
      users: [...a.querySelectorAll(".users li")].map((li) => ({
        task: text(li, "a.task"), run: text(li, ".run"), amount: text(li, ":scope > b"), text: bare(li),
        since: !!li.querySelector(".since .held")}))})),
    waiting: text(document, "h2 + section .pending") ?? text(document, "h2 + section p.muted"),
  };
}"""


def hold(flag: str, report: str, limit: float) -> int:
    """The step: say where Ray put this process, then keep the capacity until the flag file appears."""
    import json
    import os
    import time
    import uuid

    where = {"pid": os.getpid(), "tpu_name": os.environ.get("TPU_NAME"),
             "worker": os.environ.get("TPU_WORKER_ID"), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}
    path = os.path.join(report, uuid.uuid4().hex)
    with open(path + ".tmp", "w") as out:
        json.dump(where, out)
    os.replace(path + ".tmp", path)  # the test never reads half a file
    deadline = time.monotonic() + limit
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.2)
    return 1


@pytest.mark.timeout(600)
def test_slices_page_shows_who_holds_what_and_nothing_is_left(cluster, airflow, tmp_path: Path):
    url, token = cluster.dashboard_url, cluster.token
    assert wait_until(lambda: _idle(url, token), timeout=120, interval=2), (
        f"the cluster is not idle, so the page cannot show exactly our steps: {_snap(url, token).model_dump_json()}")

    run_id = f"e2e-{uuid.uuid4().hex[:8]}"
    flag = tmp_path / "release"
    specs = {}
    for task_id, request in STEPS.items():
        report = tmp_path / task_id
        report.mkdir()
        specs[task_id] = StepSpec.for_function(
            hold, request=request, kwargs={"flag": str(flag), "report": str(report), "limit": HOLD_LIMIT_S},
            capacity_timeout=240, owner=Owner(dag_id=DAG, run_id=run_id, task_id=task_id))
    ids = _sync(_submit(url, token, list(specs.values())))
    ray_procs: dict[int, str] = {}
    try:
        where = _wait_until_held(url, token, run_id, tmp_path)
        ray_procs = _ray_processes(url, token, ids)
        assert {w["pid"] for ws in where.values() for w in ws} <= set(ray_procs), (where, ray_procs)

        with browser_page("slices-page-failure.png") as page:
            _check_busy_page(page, airflow, run_id, where)
            _check_anonymous_is_refused(airflow, run_id)
            flag.touch()
            assert _sync(_wait_jobs(url, token, ids, 180)), "our steps did not end after release"
            _check_free_page(page, airflow)
    finally:
        flag.touch()
        leftover = _sync(_end_jobs(url, token, ids))
    assert not leftover, f"jobs we had to stop: {leftover}"

    # Released: every chip and share free, nothing pending, our jobs ended by the release (not stopped).
    snap = wait_until(lambda: _idle(url, token), timeout=60, interval=1)
    assert snap, f"capacity still held after release: {_snap(url, token).model_dump_json()}"
    assert sum(h.chips for s in snap.slices for h in s.hosts if h.state == "free") == TOTAL_TPU_CHIPS
    assert [(n.used, n.free, n.shares) for n in snap.gpu_nodes] == [(0, 3, [])]
    statuses = _sync(_statuses(url, token, ids))
    assert set(statuses.values()) == {"SUCCEEDED"}, statuses

    # Every process our jobs started is gone (the shared Airflow's are checked when it stops).
    still = wait_until(lambda: not _still_running(ray_procs), timeout=60, interval=1)
    assert still, f"Ray processes of our jobs still running: {_still_running(ray_procs)}"


# --------------------------------------------------------------------------- the page


def _check_busy_page(page, airflow: AirflowStack, run_id: str, where: dict[str, list[dict]]) -> None:
    from playwright.sync_api import expect

    expect.set_options(timeout=60_000)
    # Log in through the UI, then open the plugin's page inside Airflow (its nav entry's route).
    page.goto(f"{airflow.url}/plugin/slices")
    page.fill("input[name=username]", airflow.username)
    page.fill("input[name=password]", airflow.password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url("**/plugin/slices**")
    frame_locator = page.frame_locator("iframe[src*='/rayslice/']")
    expect(frame_locator.locator("article.gpu .users li").first).to_be_visible()
    embedded = wait_until(lambda: _read_embedded(page), timeout=60, interval=1)
    assert embedded, f"no Slices page drawn inside Airflow's UI: frames {[f.url for f in page.frames]}"

    # The same page on its own, full height, for the screenshot (the UI's iframe scrolls inside).
    page.goto(f"{airflow.url}/rayslice/")
    shown = page.evaluate(_READ_PAGE)
    page.screenshot(path=ARTIFACTS / "slices-page-busy.png", full_page=True)
    assert embedded == shown, f"Airflow's UI shows {embedded}, the page itself {shown}"
    assert shown["error"] is None, shown["error"]

    # Exactly two slices busy, each with the step that Ray put there; the other v6e-16 free.
    ran_on = {task: {w["tpu_name"] for w in where[task]} for task in SLICE_STEPS}
    assert all(len(names) == 1 for names in ran_on.values()), ran_on
    busy = {s["name"]: s for s in shown["slices"] if s["state"] != "free"}
    assert set(busy) == {next(iter(ran_on[t])) for t in SLICE_STEPS}, (busy, ran_on)
    for task in SLICE_STEPS:
        card = busy[next(iter(ran_on[task]))]
        assert card["state"] == "running" and set(card["hosts"]) == {"running"}, card
        assert len(card["hosts"]) == len(where[task]) == STEPS[task].total_hosts, (card, where[task])
        assert card["task"] == f"{DAG} / {task}" and card["run"] == run_id, card
        assert card["job"].startswith("Ray running") and STEPS[task].pod_type in card["meta"], card
        assert card["since"], card  # a held slice says since when
    [free] = [s for s in shown["slices"] if s["state"] == "free"]
    assert free["meta"].startswith("v6e-16") and set(free["hosts"]) == {"free"}, free
    assert free["holder"] == "free for the next step" and free["task"] is None, free

    # One GPU node: 0.5 of its 3 GPUs in use, by our two steps, each 0.25 on the GPU Ray gave it.
    [gpu] = shown["gpus"]
    assert (gpu["meta"], gpu["pill"], gpu["segments"]) == ("0.5 of 3 GPUs in use", "2.5 free", 2), gpu
    cuda = {task: [w["cuda"] for w in where[task]] for task in GPU_STEPS}
    assert all(len(c) == 1 for c in cuda.values()) and len({c[0] for c in cuda.values()}) == 1, (
        f"the two quarter-GPU steps are not on the same GPU: {cuda}")
    assert all(u["since"] for u in gpu["users"]), gpu["users"]
    users = sorted((u["task"], u["run"], u["amount"]) for u in gpu["users"])
    assert users == [(f"{DAG} / {task}", run_id, f"0.25 GPU on GPU {cuda[task][0]}") for task in GPU_STEPS], users

    assert shown["tiles"] == {"TPU chips busy": "20 / 36", "slices free": "1 / 3", "GPUs in use": "0.5 / 3",
                              "waiting for capacity": "0"}, shown["tiles"]
    assert shown["waiting"] == "Nothing is waiting for capacity.", shown["waiting"]


def _read_embedded(page) -> dict | None:
    """The page as drawn in the UI's iframe; None until drawn (the UI may remount the iframe while it loads)."""
    for frame in page.frames:
        if "/rayslice/" in frame.url and not frame.is_detached():
            try:
                shown = frame.evaluate(_READ_PAGE)
            except Exception:  # navigated or detached between the check and the call: read again
                continue
            if shown["slices"] and shown["gpus"]:
                return shown
    return None


def _check_anonymous_is_refused(airflow: AirflowStack, run_id: str) -> None:
    api = f"{airflow.url}/rayslice/api/capacity"
    anonymous = httpx.get(api, timeout=60)
    assert anonymous.status_code in (401, 403), (anonymous.status_code, anonymous.text[:300])
    assert run_id not in anonymous.text
    # The same URL with admin's token answers: the refusal above is the auth, not a broken route.
    signed_in = httpx.get(api, timeout=60, headers={"Authorization": f"Bearer {airflow.api_token()}"})
    assert signed_in.status_code == 200 and run_id in signed_in.text, signed_in.text[:300]


def _check_free_page(page, airflow: AirflowStack) -> None:
    def all_free() -> dict | None:
        page.goto(f"{airflow.url}/rayslice/")
        shown = page.evaluate(_READ_PAGE)
        return shown if shown["gpus"] and shown["gpus"][0]["meta"] == "0 of 3 GPUs in use" and all(
            s["state"] == "free" for s in shown["slices"]) else None

    shown = wait_until(all_free, timeout=60, interval=2)
    assert shown, f"the page still shows held capacity after release: {page.evaluate(_READ_PAGE)}"
    page.screenshot(path=ARTIFACTS / "slices-page-free.png", full_page=True)
    assert [(s["name"], s["state"], set(s["hosts"]), s["task"]) for s in shown["slices"]] == [
        ("v6e-16-a", "free", {"free"}, None), ("v6e-16-b", "free", {"free"}, None), ("v6e-4-a", "free", {"free"}, None)]
    [gpu] = shown["gpus"]
    assert (gpu["pill"], gpu["segments"], [u["text"] for u in gpu["users"]]) == (
        "3 free", 0, ["no one is using it"]), gpu
    assert shown["tiles"]["TPU chips busy"] == "0 / 36" and shown["tiles"]["GPUs in use"] == "0 / 3", shown["tiles"]


# --------------------------------------------------------------------------- the cluster


def _snap(url: str, token: str | None) -> capacity.Snapshot:
    return capacity.snapshot(url, token=token)


def _idle(url: str, token: str | None) -> capacity.Snapshot | None:
    snap = _snap(url, token)
    quiet = all(s.state == "free" for s in snap.slices) and all(n.used == 0 for n in snap.gpu_nodes)
    return snap if quiet and not snap.pending else None


def _wait_until_held(url: str, token: str | None, run_id: str, reports: Path) -> dict[str, list[dict]]:
    """Until every step runs on all its hosts and the dashboard knows the GPU shares' indices."""
    def held() -> dict[str, list[dict]] | None:
        where = {task: [json.loads(f.read_text()) for f in (reports / task).iterdir() if f.suffix != ".tmp"]
                 for task in STEPS}
        if any(len(where[task]) != getattr(STEPS[task], "total_hosts", 1) for task in STEPS):
            return None
        snap = _snap(url, token)
        ours = {s.holder.task_id for s in snap.slices
                if s.holder and s.holder.run_id == run_id and all(h.state == "running" for h in s.hosts)}
        shares = {sh.holder.task_id for n in snap.gpu_nodes for sh in n.shares
                  if sh.holder.run_id == run_id and sh.state == "running" and sh.gpus}
        return where if ours == set(SLICE_STEPS) and shares == set(GPU_STEPS) else None

    where = wait_until(held, timeout=300, interval=2)
    assert where, f"our steps never all held their capacity: {_snap(url, token).model_dump_json()}"
    return where


def _sync(coro):
    """Run a coroutine to its end from sync code, also inside Playwright's sync API (whose thread has a loop)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _submit(url: str, token: str | None, specs: list[StepSpec]) -> list[str]:
    async with AsyncRayJobsClient(url, token=token) as client:
        return [await submit_step(client, spec) for spec in specs]


def _ray_processes(url: str, token: str | None, ids: list[str]) -> dict[int, str]:
    """pid -> start time (psutil's create_time) of each job's driver, supervisor and step actors."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    actors = httpx.get(f"{url}/api/v0/actors", headers=headers, timeout=30, params={
        "detail": "1", "limit": "10000", "filter_keys": "state", "filter_predicates": "=",
        "filter_values": "ALIVE"}).json()["data"]["result"]["result"]
    pids = {a["pid"] for a in actors if a.get("pid") and any(sid in (a.get("name") or "") for sid in ids)}
    jobs = httpx.get(f"{url}/api/jobs/", headers=headers, timeout=30).json()
    pids |= {j["driver_info"]["pid"] for j in jobs if j.get("submission_id") in ids and j.get("driver_info")}
    assert len(pids) >= len(ids), f"found {pids} for jobs {ids}"
    return {int(pid): _start_time(int(pid)) for pid in pids}


def _start_time(pid: int) -> str:
    try:
        return str(psutil.Process(pid).create_time())
    except psutil.Error:
        return ""


def _still_running(procs: dict[int, str]) -> dict[int, str]:
    """The same processes (pid and start time: not a reused pid), still alive."""
    return {pid: started for pid, started in procs.items() if alive(pid) and _start_time(pid) == started}


async def _wait_jobs(url: str, token: str | None, ids: list[str], timeout: float) -> bool:
    async with AsyncRayJobsClient(url, token=token) as client:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all([(await client.get(sid)).is_terminal for sid in ids]):
                return True
            await asyncio.sleep(1)
    return False


async def _end_jobs(url: str, token: str | None, ids: list[str]) -> list[str]:
    """Wait for our jobs to end (the flag is down); stop any that do not. Returns the ones stopped."""
    if await _wait_jobs(url, token, ids, 120):
        return []
    async with AsyncRayJobsClient(url, token=token) as client:
        stopped = [sid for sid in ids if not (await client.get(sid)).is_terminal]
        for sid in stopped:
            await client.stop(sid)
    await _wait_jobs(url, token, ids, 60)
    return stopped


async def _statuses(url: str, token: str | None, ids: list[str]) -> dict[str, str]:
    async with AsyncRayJobsClient(url, token=token) as client:
        return {sid: (await client.get(sid)).status.value for sid in ids}


# --------------------------------------------------------------------------- names any code on the cluster sets

_IMG = "<img src=x onerror=window.__pwned=1>"
_SVG = "<svg onload=window.__pwned=1>"
_PLANT = """
import sys, time, os, ray
sid, flag, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
ray.init(logging_level="ERROR")

@ray.remote(num_cpus=0, num_gpus=0.25)
class Planted:
    def ready(self):
        return 1

# One named after its job (a bar of its DAG), one with a name no job has (a bar of no DAG).
actors = [Planted.options(name=f"rayslice:{sid}/GPU").remote(), Planted.options(name=sys.argv[4]).remote()]
ray.get([a.ready.remote() for a in actors])
deadline = time.monotonic() + limit
while not os.path.exists(flag) and time.monotonic() < deadline:
    time.sleep(0.2)
for actor in actors:
    ray.kill(actor)
"""


@pytest.mark.timeout(720)  # the first e2e test of a run also pays for Airflow's start
def test_names_planted_on_the_cluster_are_shown_as_text(cluster, airflow, tmp_path: Path):
    """A Ray job's metadata and an actor's name are markup-shaped: the page shows them as text, runs nothing.

    Then the job's record is deleted (`ray job delete`; the actor table keeps its actors): its bars
    can no longer be traced to a DAG, so they are drawn as hidden, not by the names they carry.
    """
    from playwright.sync_api import expect

    from rayslice.client import usage

    url, token = cluster.dashboard_url, cluster.token
    sid, flag = f"planted-{uuid.uuid4().hex[:8]}", tmp_path / "release"
    script = tmp_path / "plant.py"
    script.write_text(_PLANT)
    metadata = {"rayslice": "1", "dag_id": _SVG, "run_id": "r1", "task_id": _IMG, "request": _SVG}
    entrypoint = f"{sys.executable} {script} {sid} {flag} 300 'rayslice:{_IMG}/GPU'"
    _sync(_plant(url, token, entrypoint, sid, metadata))
    try:
        def both_bars() -> list | None:
            bars = [b for b in usage.usage(url, token, hours=1).bars if b.submission_id in (sid, _IMG) and not b.end]
            return bars if len(bars) == 2 else None

        assert wait_until(both_bars, timeout=300, interval=2), f"the planted actors never ran: {_job_log(url, sid)}"
        with browser_page("slices-page-names-failure.png") as page:
            page.context.add_cookies([{"name": "_token", "value": airflow.api_token(), "url": airflow.url}])
            # Both refreshes of the page's own script must also leave the names as text.
            with page.expect_response(lambda r: "/rayslice/usage" in r.url, timeout=90_000), \
                    page.expect_response(lambda r: "/rayslice/api/capacity" in r.url, timeout=90_000):
                page.goto(f"{airflow.url}/rayslice/?hours=1")
                assert page.evaluate("window.__pwned") is None, "a name from Ray ran as script on load"
            page.wait_for_timeout(500)  # let the swapped-in markup load (an <img> fails, an <svg> loads)
            page.screenshot(path=ARTIFACTS / "slices-page-names.png", full_page=True)
            assert page.evaluate("window.__pwned") is None, "a name from Ray ran as script after a refresh"
            share = page.locator("article.gpu .users li", has=page.locator("a.task", has_text=_SVG))
            expect(share.first).to_contain_text(f"{_SVG} / {_IMG}")  # the live view: literally
            tips = page.locator("#usage .tip").all_text_contents()
            assert any(t.startswith(f"{_SVG} / {_IMG}") for t in tips), tips  # the timeline: literally
            assert not page.locator("img, svg[onload]").count(), page.content()[:2000]
    finally:
        flag.touch()
        _sync(_unplant(url, token, sid))

    # Deleted: nothing names the DAG any more; every bar of it is hidden (the admin sees the bill, not names).
    api = httpx.Client(base_url=airflow.url, timeout=60, headers={"Authorization": f"Bearer {airflow.api_token()}"})

    def hidden() -> dict | None:
        body = api.get("/rayslice/api/usage", params={"hours": 1}).json()
        ours = [b for b in body["bars"] if b["submission_id"] in (sid, _IMG) or b["hidden"]]
        return body if ours and _IMG not in json.dumps(body) and sid not in json.dumps(body) else None

    assert wait_until(hidden, timeout=90, interval=3), api.get("/rayslice/api/usage", params={"hours": 1}).text[:3000]


async def _plant(url: str, token: str | None, entrypoint: str, sid: str, metadata: dict) -> None:
    async with AsyncRayJobsClient(url, token=token) as client:
        await client.submit(entrypoint, submission_id=sid, metadata=metadata)


async def _unplant(url: str, token: str | None, sid: str) -> None:
    """Stop the planted job if the flag did not end it, then delete its record."""
    async with AsyncRayJobsClient(url, token=token) as client:
        deadline = time.monotonic() + 60
        while not (await client.get(sid)).is_terminal:
            if time.monotonic() > deadline:
                await client.stop(sid)
            await asyncio.sleep(0.5)
        await client.delete(sid)


def _job_log(url: str, sid: str) -> str:
    return httpx.get(f"{url}/api/jobs/{sid}/logs", timeout=30).text[-2000:]
