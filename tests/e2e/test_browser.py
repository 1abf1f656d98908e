"""End to end in a real browser: trigger the training pipeline from Airflow's UI, watch its slice on the Slices page.

A real Airflow 3 (`rayslice.local.airflow_stack`: api-server, scheduler, dag-processor, triggerer)
runs against the session's local Ray cluster; headless Chromium logs in, fills the trigger
form (slice type, learning rate, steps), and follows the run until it succeeds, looking at the
Slices page while the training step holds its v6e-4 slice and again once it is released,
then finds the run on the usage timeline (a bar on the slice's lane, the right DAG, task and
run) and its non-zero TPU chip-hours and GPU-hours in the per-task table.
Screenshots go to `artifacts/` for humans (and CI) to look at; `scripts/screenshot` copies
the timeline's to `docs/slices-page.png` for the README.

Every wait is for a condition, with a generous deadline: this runs on loaded two-core machines.
"""

from __future__ import annotations

import re
import time
import uuid

import httpx
import pytest

from rayslice.local.airflow_stack import AirflowStack
from tests.airflow_cli import get_json as _get
from tests.e2e.conftest import ARTIFACTS, browser_page, needs_chromium

DAG_ID = "rayslice_training_pipeline"
# Enough steps that `train` holds its slice for several of the page's refreshes: with the default 6
# it can start and end between two of them.
# 300 training steps hold the slice for about half a minute: a step that starts in the triggerer
# runs at once, and on a loaded machine one reading of the Slices page takes seconds.
SLICE_TYPE, LEARNING_RATE, STEPS = "v6e-4", "0.05", "300"
RUN_TIMEOUT_S = 240

pytestmark = needs_chromium
_BUSY = re.compile(r"\b(running|reserved)\b")
_FREE = re.compile(r"\bfree\b")


@pytest.mark.timeout(720)  # the first e2e test also pays for Airflow's start: ~90 s, up to 4 min on a loaded machine
def test_trigger_from_the_ui_and_watch_the_slice(airflow):
    api = httpx.Client(base_url=f"{airflow.url}/api/v2", timeout=45,
                       headers={"Authorization": f"Bearer {airflow.api_token()}"})
    with browser_page("e2e-failure.png", f"; Airflow logs: {airflow.home}/logs") as page:
        _run_pipeline_from_the_ui(page, airflow, api)


def _run_pipeline_from_the_ui(page, airflow: AirflowStack, api: httpx.Client) -> None:
    from playwright.sync_api import expect

    expect.set_options(timeout=60_000)  # not the 5 s default: a loaded machine's API can stall that long
    # Log in (the UI sends us to the simple auth manager's form and back).
    _wait_for(lambda: _get(api, f"/dags/{DAG_ID}"), 120,
              f"the DAG processor did not register {DAG_ID} from dags/ within 120 s")
    page.goto(f"{airflow.url}/dags/{DAG_ID}")
    page.fill("input[name=username]", airflow.username)
    page.fill("input[name=password]", airflow.password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"**/dags/{DAG_ID}**")

    # The trigger form: pick the slice type, set the learning rate, name the run.
    page.get_by_role("button", name="Trigger Dag").click()
    form = page.get_by_role("dialog")
    expect(form.get_by_text(f"Trigger Dag - {DAG_ID}")).to_be_visible()
    form.get_by_label("TPU slice type").click()  # the Param's enum, offered as a drop-down
    page.get_by_role("option", name=SLICE_TYPE, exact=True).click()
    expect(form.locator("input[name=element_slice_type]")).to_have_value(SLICE_TYPE)
    form.locator("input[name=element_learning_rate]").fill(LEARNING_RATE)
    form.locator("input[name=element_steps]").fill(STEPS)
    form.get_by_role("button", name="Advanced Options").click()
    run_id = f"e2e-{uuid.uuid4().hex[:8]}"
    form.locator("input[name=dagRunId]").fill(run_id)
    form.get_by_test_id("trigger-dag-submit").click()
    expect(form).to_be_hidden()

    run = _wait_for(lambda: _get(api, f"/dags/{DAG_ID}/dagRuns/{run_id}"), 120,
                    f"the trigger form did not create run {run_id}")
    want = {"slice_type": SLICE_TYPE, "learning_rate": float(LEARNING_RATE), "steps": int(STEPS)}
    assert run["conf"] == want, run["conf"]

    # The Slices page (inside Airflow's UI) while `train` runs: our run holds a v6e-4 slice.
    page.get_by_role("link", name="Slices").click()  # the plugin's nav entry: /rayslice/ in an iframe
    slices = page.frame_locator("iframe[src*='/rayslice/']")
    held = slices.locator("article.slice", has=slices.locator("span.run", has_text=run_id))
    expect(slices.locator("article.slice").first).to_be_visible()
    frame = next(f for f in page.frames if "/rayslice/" in f.url)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not held.count():
        ended = _finished(api, run_id)
        assert not ended and time.monotonic() < deadline, (
            f"the Slices page never showed a slice held by run {run_id} (run {ended and ended['state']}); "
            f"task states: {_task_states(api, run_id)}")
        frame.goto(frame.url)  # a fresh reading, sooner than the page's own 5 s refresh
        time.sleep(0.5)
    expect(held).to_have_class(_BUSY)
    expect(held.locator(".meta")).to_contain_text(SLICE_TYPE)
    slice_name = held.locator("h3").inner_text()
    page.screenshot(path=ARTIFACTS / "e2e-slices-busy.png", full_page=True)

    run = _wait_for(lambda: _finished(api, run_id), RUN_TIMEOUT_S,
                    f"run {run_id} did not finish within {RUN_TIMEOUT_S} s")
    assert run["state"] == "success", f"run {run_id} ended {run['state']}; task states: {_task_states(api, run_id)}"

    # Released: the page refreshes itself every few seconds.
    card = slices.locator("article.slice", has=slices.locator("h3", has_text=re.compile(f"^{re.escape(slice_name)}$")))
    expect(card).to_have_class(_FREE, timeout=60_000)
    page.screenshot(path=ARTIFACTS / "e2e-slices-free.png", full_page=True)
    _find_the_run_on_the_timeline(page, airflow, run_id, slice_name)

    page.goto(f"{airflow.url}/dags/{DAG_ID}/runs/{run_id}")
    expect(page.get_by_text(run_id).first).to_be_visible()
    expect(page.get_by_text("success").first).to_be_visible()
    page.screenshot(path=ARTIFACTS / "e2e-dag-run.png", full_page=True)


def _find_the_run_on_the_timeline(page, airflow: AirflowStack, run_id: str, slice_name: str) -> None:
    """The run's `train` step is a bar on its slice's lane; its details link the task instance; it was billed."""
    from playwright.sync_api import expect

    page.goto(f"{airflow.url}/rayslice/?hours=1")  # the page on its own: the timeline at full width
    lane = page.locator(".lane", has=page.locator(".lane-name", has_text=re.compile(f"^{re.escape(slice_name)}")))
    bar = lane.locator("a.step", has=page.locator(".tip", has_text=f"{DAG_ID} / train"))
    deadline = time.monotonic() + 60
    while not bar.count():  # the server re-reads usage every 10 s
        assert time.monotonic() < deadline, f"no bar of {DAG_ID} / train on lane {slice_name}: {lane.inner_html()}"
        time.sleep(2)
        page.reload()
    bar = bar.last  # the newest of this DAG's train steps on that slice: ours
    bar.hover()
    expect(bar.locator(".tip")).to_be_visible()
    expect(bar.locator(".tip")).to_contain_text("chip-hours")
    bar.click()
    detail = page.locator(".step-detail:target")
    expect(detail).to_be_visible()
    expect(detail.locator(".run")).to_have_text(run_id)
    task_link = detail.locator("a.task")
    expect(task_link).to_have_attribute("href", f"/dags/{DAG_ID}/runs/{run_id}/tasks/train")
    expect(detail.locator("a.job")).to_have_attribute("href", re.compile(r"/#/jobs/rayslice-"))
    expect(detail).to_contain_text(f"{slice_name} · {SLICE_TYPE} · 4 chips")
    page.screenshot(path=ARTIFACTS / "e2e-usage-timeline.png", full_page=True)

    rows = {}
    for row in page.locator("table.by-task tr").all()[1:]:
        cells = [c.inner_text().strip() for c in row.locator("td").all()]
        rows[(cells[0], cells[1])] = cells[2:]
    steps, chip_hours, gpu_hours, goodput = rows[(DAG_ID, "train")]
    assert int(steps) >= 1 and float(chip_hours.lstrip("<")) > 0 and gpu_hours == "0", rows
    # Goodput of the train steps whose job log Ray still lists with the figures ("-" for none of them).
    assert re.fullmatch(r"(\d+\.\d%( \(\d+ of \d+ steps\))?|-)", goodput), rows
    assert float(rows[(DAG_ID, "evaluate")][2].lstrip("<")) > 0, rows  # the quarter GPU, in GPU-hours

    task_link.click()  # the task instance in Airflow's UI
    page.wait_for_url(f"**/dags/{DAG_ID}/runs/{run_id}/tasks/train**")




def _finished(api: httpx.Client, run_id: str) -> dict | None:
    run = _get(api, f"/dags/{DAG_ID}/dagRuns/{run_id}")
    return run if run and run["state"] in ("success", "failed") else None


def _task_states(api: httpx.Client, run_id: str) -> dict[str, str]:
    body = _get(api, f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances") or {"task_instances": []}
    return {ti["task_id"]: ti["state"] for ti in body["task_instances"]}


def _wait_for(condition, timeout: float, message: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            assert value, message
            return value
        time.sleep(interval)
