"""Deferrable steps start in the triggerer under real Airflow: no task process for a step that succeeds.

6 mapped quarter-GPU steps (two per GPU of three: fewer would not spread over them, more only cost
CI time), mapped over an upstream task's output with a partial argument, run with every map index's
own argument, and no Airflow task process runs for any of them: a task instance a worker ran carries
that process's pid (the Task SDK reports it when the task starts), and these never do. Their XComs
(read by a downstream task), task logs (the step's own lines), the submission id behind the "Ray
job" link are there as on the worker path, each on its own quarter of one logical GPU, and every GPU
is free after. A step that fails resumes on a worker to raise (Airflow's retries apply) and its
retry starts in the triggerer again. The scheduler race that `min_deferral` works around needs a
worker that deferred: none did here, and no task waited for it. (The example DAG
`rayslice_gpu_fraction_mapping`, the same shape with JAX in each step, runs under `dag.test()` in
tests/dags/test_example_dags.py.)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from rayslice.client.jobs_client import JobStatus, RayJobsClient
from tests.airflow_cli import get_json
from tests.conftest import wait_until
from tests.e2e.conftest import add_dags

DAGS = Path(__file__).parent / "dags" / "trigger_start.py"
MAPPED = "ts_mapped"
ITEMS = 6

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def api(airflow, airflow_api):
    return add_dags(airflow, airflow_api, DAGS, (MAPPED, "ts_retry"))


def _run(api: httpx.Client, dag_id: str, timeout: float, conf: dict | None = None) -> tuple[str, list[dict]]:
    run_id = f"ts-{time.time_ns()}"
    api.post(f"/dags/{dag_id}/dagRuns",
             json={"dag_run_id": run_id, "logical_date": None, "conf": conf or {}}).raise_for_status()

    def state() -> str | None:  # None: not there yet, or the API stalled (poll again)
        return (get_json(api, f"/dags/{dag_id}/dagRuns/{run_id}") or {}).get("state")

    assert wait_until(lambda: state() in ("success", "failed"), timeout=timeout, interval=2), state()
    tis = api.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 100}).json()["task_instances"]
    return run_id, tis


def _xcom(api: httpx.Client, dag_id: str, run_id: str, task_id: str, key: str, map_index: int = -1):
    resp = api.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}",
                   params={"map_index": map_index, "deserialize": True})
    resp.raise_for_status()
    value = resp.json()["value"]
    try:
        return json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        return value


def _log(api: httpx.Client, dag_id: str, run_id: str, task_id: str, try_number: int, map_index: int = -1) -> str:
    """The try's log as the UI shows it: the task process's, if one ran, and the trigger's."""
    resp = api.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
                   params={"map_index": map_index, "full_content": True})
    resp.raise_for_status()
    content = resp.json()["content"]
    return "\n".join(json.dumps(entry) if isinstance(entry, dict) else str(entry) for entry in content)


#: What every task process logs as it ends (the Task SDK's task runner); a trigger never does.
TASK_PROCESS_LINE = "::group::Post Execute"


def test_mapped_steps_start_and_end_in_the_triggerer_without_a_task_process(api, cluster, ray_driver):
    run_id, tis = _run(api, MAPPED, 900)
    steps = {ti["map_index"]: ti for ti in tis if ti["task_id"] == "step"}
    assert {i: ti["state"] for i, ti in steps.items()} == dict.fromkeys(range(ITEMS), "success")
    # A downstream task reads every step's value as the step returned it (a dict, not its JSON).
    assert [ti["state"] for ti in tis if ti["task_id"] == "total"] == ["success"]
    assert _xcom(api, MAPPED, run_id, "total", "return_value") == sum(range(ITEMS))
    # A task process reports its pid when it starts (the Task SDK's ti_run); none ran.
    assert [ti["pid"] for ti in steps.values() if ti["pid"] is not None] == []
    assert all(ti["try_number"] == 1 for ti in steps.values())
    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as jobs:
        ours = {int(j.metadata["map_index"]): j for j in jobs.list_jobs()
                if (j.metadata or {}).get("dag_id") == MAPPED and j.metadata.get("run_id") == run_id}
        assert sorted(ours) == list(range(ITEMS))
        assert all(j.status == JobStatus.SUCCEEDED for j in ours.values())
    for index in range(ITEMS):
        result = _xcom(api, MAPPED, run_id, "step", "return_value", index)
        assert result["item"] == index and result["scale"] == 10  # its own map index's argument, and the partial
        assert result["gpu"] in {"0", "1", "2"}  # one quarter of one logical GPU
    for index in (0, ITEMS // 2, ITEMS - 1):
        sid = _xcom(api, MAPPED, run_id, "step", "ray_submission_id", index)
        assert sid == ours[index].submission_id
        links = api.get(f"/dags/{MAPPED}/dagRuns/{run_id}/taskInstances/step/links",
                        params={"map_index": index}).json()["extra_links"]
        assert (links.get("Ray job") or "").endswith(f"/rayslice/job/{sid}?conn_id=ray_default"), links
        log = _log(api, MAPPED, run_id, "step", 1, index)
        assert all(f"item {index} line {n}" in log for n in range(3)), log[-3000:]  # the step's own lines
        assert "min_deferral" not in log  # nothing waited for the scheduler race
        assert TASK_PROCESS_LINE not in log
    total = ray_driver.cluster_resources().get("GPU", 0)
    assert wait_until(lambda: ray_driver.available_resources().get("GPU", 0) >= total, timeout=30, interval=0.2), (
        f"GPUs still held after the run: {ray_driver.available_resources().get('GPU')} of {total} free")


def test_a_failing_step_is_retried_and_the_retry_starts_in_the_triggerer(api, cluster):
    run_id, tis = _run(api, "ts_retry", 400)
    (ti,) = [ti for ti in tis if ti["task_id"] == "flaky"]
    assert ti["state"] == "success" and ti["try_number"] == 2, ti
    assert [t["state"] for t in tis if t["task_id"] == "echo"] == ["success"]  # it read "try 2" itself
    assert _xcom(api, "ts_retry", run_id, "flaky", "return_value") == "try 2"
    first = _log(api, "ts_retry", run_id, "flaky", 1)  # resumed on a worker to raise: a task process ran
    assert "try 1 fails on purpose" in first and "RayStepFailed" in first and TASK_PROCESS_LINE in first, first[-3000:]
    second = _log(api, "ts_retry", run_id, "flaky", 2)
    assert "succeeded" in second and TASK_PROCESS_LINE not in second, second[-3000:]
    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as jobs:
        ours = sorted((int(j.metadata["try_number"]), j.status) for j in jobs.list_jobs()
                      if (j.metadata or {}).get("dag_id") == "ts_retry" and j.metadata.get("run_id") == run_id)
    assert ours == [(1, JobStatus.FAILED), (2, JobStatus.SUCCEEDED)]
