"""A slice step's lifecycle under real Airflow (scheduler, triggerer, LocalExecutor) on the real Ray cluster.

What `dag.test()` cannot show: a deferred task parked in the triggerer while its job waits for a
slice; a user's "mark failed" (the REST call the UI makes) reaching a running task through the
worker's heartbeat, or a deferred one through the triggerer; and `execution_timeout` in both modes.
After a kill or a timeout the Ray job must be STOPPED and every chip free within 5 s. (A retry
scheduled by the real scheduler, one Ray job per try: tests/e2e/test_trigger_start.py, and in both
modes tests/e2e/test_trigger_parity.py.)

One Airflow stack serves the whole module, over the DAGs in `tests/e2e/dags/`. The scenarios
run one after another: each holds the cluster's only v6e-4 slice and checks that all chips
are free at its end.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from rayslice.client.jobs_client import JobStatus, RayJobsClient
from rayslice.client.submission import jobs_of_task
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.exceptions import RaysliceError
from rayslice.core.step import Owner
from rayslice.local.airflow_stack import AirflowStack
from tests.airflow_cli import get_json as _get
from tests.conftest import TOTAL_TPU_CHIPS, wait_until

DAGS = Path(__file__).with_name("dags")
DAG_IDS = ("lc_wait", "lc_kill_running", "lc_kill_deferred", "lc_timeout_running", "lc_timeout_deferred")
KILL_BOUND_S = 5.0  # the must-hold: job STOPPED and every chip free this soon after a kill or a timeout
STEP_START_S = 180  # a generous deadline for a step to start on a loaded two-core machine

# The first test also pays for the stack's start (~90 s, up to 4 min on an overloaded machine).
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def api(airflow):
    with httpx.Client(base_url=f"{airflow.url}/api/v2", timeout=60,
                      headers={"Authorization": f"Bearer {airflow.api_token()}"}) as client:
        missing = set(DAG_IDS)
        deadline = time.monotonic() + 180
        while missing and time.monotonic() < deadline:
            missing = {d for d in missing if _get(client, f"/dags/{d}") is None}
            time.sleep(1)
        assert not missing, f"the DAG processor did not register {sorted(missing)} from {DAGS}"
        yield client


@pytest.fixture(scope="module")
def jobs(cluster):
    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
        yield client


@pytest.fixture(autouse=True)
def leaves_the_cluster_clean(jobs, ray_driver):
    """Every scenario ends with no job of ours alive and every chip free (leftovers are stopped, then fail)."""
    yield
    alive = [j.submission_id for j in jobs.list_jobs()
             if (j.metadata or {}).get("dag_id", "").startswith("lc_") and not j.is_terminal]
    for sid in alive:
        jobs.stop(sid)
    free = wait_until(lambda: _tpu_free(ray_driver), timeout=30, interval=0.2)
    assert not alive, f"Ray jobs still running after the scenario: {alive}"
    assert free, f"TPU chips still busy after the scenario: {ray_driver.available_resources().get('TPU')}"


def test_a_deferred_step_waits_for_capacity_then_completes(airflow, api, jobs, ray_driver):
    from rayslice.cluster.reservation import reserve_slices

    hold = reserve_slices(TpuSliceRequest(tpu="v6e-4"), timeout=60, name=f"rayslice:test-hold-{uuid.uuid4().hex[:6]}")
    try:
        run = _trigger(api, "lc_wait")
        _wait_state(api, "lc_wait", run, {"deferred"}, STEP_START_S)
        # Deferred first, then submitted: the step starts in the triggerer, after the scheduler deferred it.
        sid = wait_until(lambda: _sid(jobs, "lc_wait", run), timeout=60, interval=0.5)
        assert sid, f"lc_wait/{run} is deferred but no Ray job of it is listed after 60 s"
        # Parked: the task is in the triggerer, its job waits for the slice we hold, for as long as we hold it.
        assert wait_until(lambda: "waiting for capacity" in jobs.logs(sid), timeout=60, interval=0.5), jobs.logs(sid)
        for _ in range(10):  # 5 s, ten trigger polls
            assert _ti(api, "lc_wait", run)["state"] == "deferred"
            assert jobs.get(sid).status == JobStatus.RUNNING and "reserved" not in jobs.logs(sid)
            time.sleep(0.5)
    finally:
        hold.release()
    released = time.monotonic()
    ti = _wait_state(api, "lc_wait", run, {"success", "failed"}, 180)
    print(f"\n[lifecycle] capacity released -> task success in {time.monotonic() - released:.1f} s")
    assert ti["state"] == "success", _diagnose(airflow, api, "lc_wait", run)
    assert _xcom(api, "lc_wait", run) == ["done"]
    assert jobs.get(sid).status == JobStatus.SUCCEEDED


def test_marking_a_running_step_failed_stops_its_job(airflow, api, jobs, ray_driver):
    """The UI's "mark failed": the worker's next heartbeat learns it, SIGTERMs the task, on_kill stops the job."""
    run = _trigger(api, "lc_kill_running")
    sid = _wait_holding(airflow, api, jobs, ray_driver, "lc_kill_running", run, {"running"})
    patched = time.time()
    _mark_failed(api, "lc_kill_running", run)
    stopped, free = _wait_stopped_and_free(jobs, ray_driver, sid)
    killed = _task_log_time(airflow, "lc_kill_running", run, "shouldn't be running anymore")
    ended = max(stopped, free)
    print(f"\n[lifecycle] running kill: mark failed -> SIGTERM {killed - patched:.1f} s (the worker's heartbeat); "
          f"SIGTERM -> job STOPPED {stopped - killed:.1f} s, chips free {free - killed:.1f} s")
    assert ended - killed <= KILL_BOUND_S, f"{ended - killed:.1f} s from the kill to STOPPED + free"
    assert _ti(api, "lc_kill_running", run)["state"] == "failed"
    assert _log_shows(airflow, "lc_kill_running", run, f"stopped Ray job {sid}")  # on_kill did it


def test_marking_a_deferred_step_failed_stops_its_job(airflow, api, jobs, ray_driver):
    """A deferred task has no process: the triggerer cancels its trigger, whose on_kill stops the job."""
    run = _trigger(api, "lc_kill_deferred")
    sid = _wait_holding(airflow, api, jobs, ray_driver, "lc_kill_deferred", run, {"deferred"})
    patched = time.time()
    _mark_failed(api, "lc_kill_deferred", run)
    stopped, free = _wait_stopped_and_free(jobs, ray_driver, sid)
    ended = max(stopped, free)
    try:  # the kill: the triggerer cancelling the trigger (its pickup delay is Airflow's, like the worker heartbeat)
        killed = _task_log_time(airflow, "lc_kill_deferred", run, "stop requested")
    except (AssertionError, KeyError, ValueError):
        killed = patched
    print(f"\n[lifecycle] deferred kill: mark failed -> trigger cancelled {killed - patched:.1f} s; "
          f"mark failed -> job STOPPED {stopped - patched:.1f} s, chips free {free - patched:.1f} s")
    assert ended - killed <= KILL_BOUND_S, f"{ended - killed:.1f} s from the kill to STOPPED + free"
    assert _ti(api, "lc_kill_deferred", run)["state"] == "failed"
    assert _log_shows(airflow, "lc_kill_deferred", run, f"Ray job {sid}: stop requested")  # the trigger's on_kill


@pytest.mark.parametrize("mode", ["running", "deferred"])
def test_execution_timeout_stops_the_job(airflow, api, jobs, ray_driver, mode):
    dag_id = f"lc_timeout_{mode}"
    run = _trigger(api, dag_id)
    timeout_s = _execution_timeout_s(api, dag_id)
    sid = _wait_holding(airflow, api, jobs, ray_driver, dag_id, run, {mode})
    # The timeout counts from execute(), whose first act is pushing the submission id: a slightly late origin.
    executing = _xcom_time(api, dag_id, run, "ray_submission_id")
    held_after = time.time() - executing
    assert held_after < timeout_s, f"the step held its slice only {held_after:.1f} s into execute(): past the timeout"
    timed_out = executing + timeout_s
    stopped, free = _wait_stopped_and_free(jobs, ray_driver, sid, timeout=timeout_s + 60)
    ended = max(stopped, free)
    print(f"\n[lifecycle] {mode}: slice held {held_after:.1f} s into execute(); execution_timeout -> "
          f"job STOPPED {stopped - timed_out:.1f} s, chips free {free - timed_out:.1f} s")
    assert ended - timed_out <= KILL_BOUND_S, f"{ended - timed_out:.1f} s after the timeout"
    ti = _wait_state(api, dag_id, run, {"success", "failed", "up_for_retry"}, 120)
    assert ti["state"] == "failed", _diagnose(airflow, api, dag_id, run)
    assert _log_shows(airflow, dag_id, run, "stopped Ray job" if mode == "running" else "execution_timeout passed")


# ---------------------------------------------------------------- helpers


def _tpu_free(ray_driver) -> bool:
    return ray_driver.available_resources().get("TPU", 0) == TOTAL_TPU_CHIPS


def _jobs(jobs: RayJobsClient, dag_id: str, run: str) -> list:
    """The run's step jobs, every try: found by metadata, since ids hold each try's task-instance id."""
    return jobs_of_task(jobs.list_jobs(), Owner(dag_id=dag_id, run_id=run, task_id="step"))


def _sid(jobs: RayJobsClient, dag_id: str, run: str, try_number: int = 1) -> str | None:
    """The submission id of one try's job; None before that try submitted it."""
    found = [j.submission_id for j in _jobs(jobs, dag_id, run)
             if (j.metadata or {}).get("try_number") == str(try_number)]
    assert len(found) <= 1, f"{dag_id}/{run} try {try_number} has several jobs: {found}"
    return found[0] if found else None




def _trigger(api: httpx.Client, dag_id: str) -> str:
    run = f"lc-{uuid.uuid4().hex[:8]}"
    resp = api.post(f"/dags/{dag_id}/dagRuns", json={"dag_run_id": run, "logical_date": None})
    assert resp.status_code == 200, resp.text
    return run


def _ti(api: httpx.Client, dag_id: str, run: str) -> dict:
    return _get(api, f"/dags/{dag_id}/dagRuns/{run}/taskInstances/step") or {"state": None}


def _wait_state(api: httpx.Client, dag_id: str, run: str, states: set[str], timeout: float) -> dict:
    ti = wait_until(lambda: (t := _ti(api, dag_id, run))["state"] in states and t, timeout=timeout, interval=0.5)
    assert ti, f"{dag_id}/{run}: task not in {states} within {timeout:.0f} s (now {_ti(api, dag_id, run)['state']})"
    return ti


def _wait_holding(airflow, api, jobs, ray_driver, dag_id: str, run: str, states: set[str]) -> str:
    """Wait until the step runs on its slice (chips held) while the task is in one of `states`."""
    sids: list[str] = []

    def holding() -> bool:
        try:
            sid = _sid(jobs, dag_id, run)
            started = sid is not None and "running on" in jobs.logs(sid)
        except RaysliceError:
            return False
        if not started:
            return False  # not submitted yet
        sids[:] = [sid]
        return not _tpu_free(ray_driver) and _ti(api, dag_id, run)["state"] in states

    assert wait_until(holding, timeout=STEP_START_S, interval=0.5), _diagnose(airflow, api, dag_id, run)
    return sids[0]


def _mark_failed(api: httpx.Client, dag_id: str, run: str) -> None:
    """What the UI's "Mark as failed" sends."""
    resp = api.patch(f"/dags/{dag_id}/dagRuns/{run}/taskInstances/step", json={"new_state": "failed"})
    assert resp.status_code == 200, resp.text


def _wait_stopped_and_free(jobs: RayJobsClient, ray_driver, sid: str, timeout: float = 60) -> tuple[float, float]:
    """The wall-clock times at which the job was first seen STOPPED and every chip free (fails after `timeout`)."""
    seen: dict[str, float] = {}

    def check() -> bool:
        if "stopped" not in seen and jobs.get(sid).status == JobStatus.STOPPED:
            seen["stopped"] = time.time()
        if "free" not in seen and _tpu_free(ray_driver):
            seen["free"] = time.time()
        return len(seen) == 2

    done = wait_until(check, timeout=timeout, interval=0.1)
    assert done, f"job {sid} is {jobs.get(sid).status}, TPU available {ray_driver.available_resources().get('TPU')}"
    return seen["stopped"], seen["free"]


def _execution_timeout_s(api: httpx.Client, dag_id: str) -> float:
    timeout = (_get(api, f"/dags/{dag_id}/tasks/step") or {}).get("execution_timeout")
    assert timeout, f"{dag_id}.step has no execution_timeout"
    return timeout["days"] * 86400 + timeout["seconds"] + timeout["microseconds"] / 1e6


def _xcom(api: httpx.Client, dag_id: str, run: str, key: str = "return_value"):
    entry = _get(api, f"/dags/{dag_id}/dagRuns/{run}/taskInstances/step/xcomEntries/{key}")
    assert entry is not None, f"no XCom {key} for {dag_id}/{run}"
    value = entry["value"]
    return json.loads(value) if isinstance(value, str) else value


def _xcom_time(api: httpx.Client, dag_id: str, run: str, key: str) -> float:
    entry = _get(api, f"/dags/{dag_id}/dagRuns/{run}/taskInstances/step/xcomEntries/{key}")
    assert entry is not None, f"no XCom {key} for {dag_id}/{run}"
    return datetime.fromisoformat(entry["timestamp"]).timestamp()


def _task_log(airflow: AirflowStack, dag_id: str, run: str) -> str:
    assert airflow.home is not None
    files = sorted((airflow.home / "logs").glob(f"dag_id={dag_id}/run_id={run}/task_id=step/*.log"))
    return "\n".join(f.read_text(errors="replace") for f in files)


def _log_shows(airflow: AirflowStack, dag_id: str, run: str, text: str) -> bool:
    """Whether the task's logs (the trigger's included) come to contain `text` (they are written asynchronously)."""
    return bool(wait_until(lambda: text in _task_log(airflow, dag_id, run), timeout=30, interval=0.5))


def _task_log_time(airflow: AirflowStack, dag_id: str, run: str, text: str) -> float:
    """When the task log's first line containing `text` was written (the supervisor logs JSON lines)."""
    for line in _task_log(airflow, dag_id, run).splitlines():
        if text in line:
            return datetime.fromisoformat(json.loads(line)["timestamp"]).timestamp()
    raise AssertionError(f"no {text!r} in the task log of {dag_id}/{run}:\n{_task_log(airflow, dag_id, run)[-3000:]}")


def _diagnose(airflow: AirflowStack, api: httpx.Client, dag_id: str, run: str) -> str:
    return (f"{dag_id}/{run}: task {_ti(api, dag_id, run)}\ntask log:\n{_task_log(airflow, dag_id, run)[-3000:]}"
            f"\nlogs in {airflow.home}/logs")
