"""The example DAG `rayslice_gpu_fraction_mapping` under real Airflow: 32 mapped quarter-GPU steps.

`dag.test()` runs mapped deferrable tasks one after another in its own process; here the real
scheduler, triggerer and LocalExecutor run all 32 as users would, each its own Ray job on 0.25
of one of the cluster's logical GPUs, waiting in the triggerer. Every step must succeed with its
own shard's result, every Ray job of the run must have succeeded, and every GPU must be free after.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from rayslice.client.jobs_client import JobStatus, RayJobsClient
from tests.conftest import wait_until

DAG_ID = "rayslice_gpu_fraction_mapping"
TASK_ID = "score"
SHARDS = 32

# Pays for the package's cluster and Airflow start, then 32 Ray jobs on a two-core machine.
pytestmark = pytest.mark.timeout(1200)


def test_32_mapped_quarter_gpu_steps_all_succeed(airflow, cluster, ray_driver):
    with httpx.Client(base_url=f"{airflow.url}/api/v2", timeout=60,
                      headers={"Authorization": f"Bearer {airflow.api_token()}"}) as api:
        assert wait_until(lambda: api.get(f"/dags/{DAG_ID}").status_code == 200, timeout=180, interval=1), (
            f"the DAG processor did not register {DAG_ID}")
        run_id = f"mapping-{time.time_ns()}"
        api.post(f"/dags/{DAG_ID}/dagRuns", json={"dag_run_id": run_id, "logical_date": None}).raise_for_status()

        def run_state() -> str | None:
            resp = api.get(f"/dags/{DAG_ID}/dagRuns/{run_id}")
            return resp.json().get("state") if resp.status_code == 200 else None

        assert wait_until(lambda: run_state() in ("success", "failed"), timeout=900, interval=2), (
            f"run {run_id} still {run_state()} after 900 s")
        tis = api.get(f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances", params={"limit": 100}).json()
        states = {ti["map_index"]: ti["state"] for ti in tis["task_instances"] if ti["task_id"] == TASK_ID}
        assert states == dict.fromkeys(range(SHARDS), "success"), states
        assert run_state() == "success"

        for shard in range(SHARDS):
            resp = api.get(f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{TASK_ID}/xcomEntries/return_value",
                           params={"map_index": shard, "deserialize": True})
            resp.raise_for_status()
            value = resp.json()["value"]
            result = json.loads(value) if isinstance(value, str) else value
            assert result["shard"] == shard  # each mapped task ran its own item
            assert result["cuda_visible_devices"] in {"0", "1", "2"}  # one quarter of one logical GPU
            assert 0 < result["score"] < 1

    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as jobs:
        ours = [j for j in jobs.list_jobs()
                if (j.metadata or {}).get("dag_id") == DAG_ID and (j.metadata or {}).get("run_id") == run_id]
        assert len({(j.metadata or {}).get("map_index") for j in ours}) == SHARDS
        assert all(j.status == JobStatus.SUCCEEDED for j in ours), [(j.submission_id, j.status) for j in ours]
    total = ray_driver.cluster_resources().get("GPU", 0)
    assert wait_until(lambda: ray_driver.available_resources().get("GPU", 0) >= total, timeout=30, interval=0.2), (
        f"GPUs still held after the run: {ray_driver.available_resources().get('GPU')} of {total} free")
