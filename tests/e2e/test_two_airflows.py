"""Two Airflows on one Ray cluster keep to their own jobs and checkpoint folders (issue 26, item 7).

Staging and prod with the same DAGs and run ids: the same (dag, run, task) runs in both. Airflow B
is `dag.test()` in its own AIRFLOW_HOME and metadata DB (a subprocess); Airflow A is the session's
real stack. B's step holds a quarter GPU; A's try 1 of the same task fails and its try 2, which
stops the earlier tries of its task, must not stop B's job; nor may `rayslice reap` against A.
Each gets its own checkpoint folder.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from rayslice.client import orphans
from rayslice.client.jobs_client import JobStatus, RayJobsClient
from rayslice.client.submission import jobs_of_task
from rayslice.core.step import Owner
from tests.airflow_cli import get_json as _get
from tests.conftest import wait_until

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "sc_twin"
DAG_FILE = REPO / "tests/e2e/dags/shared_cluster.py"

pytestmark = pytest.mark.timeout(900)

#: Airflow B: `dag.test()` of the same DAG file in a private AIRFLOW_HOME; prints the outcome as JSON.
AIRFLOW_B = textwrap.dedent("""
    import json, sys
    from datetime import datetime
    from tests import airflow_env as env

    env.init_db()
    env.use_cluster(sys.argv[1], sys.argv[2] or None)
    dags, errors = env.load_dag_file(env.TEST_DAGS / "shared_cluster.py")
    assert not errors, errors
    when = datetime.fromisoformat(sys.argv[3])
    dr = dags["sc_twin"].test(logical_date=when, run_after=when,  # run id: manual__<when>
                              run_conf={"mode": "hold", "release": sys.argv[4]})
    ti = env.task_instance(dr, "step")
    print("AIRFLOW_B " + json.dumps({"run_id": dr.run_id, "state": str(ti.state), "try_number": ti.try_number,
                                     "xcom": env.xcom_values(dr, "step")}))
""")


def test_two_airflows_with_the_same_task_keep_to_their_own_jobs(airflow, cluster, tmp_path):
    home_b = tmp_path / "airflow-b"
    (home_b / "dags").mkdir(parents=True)
    shutil.copy(DAG_FILE, home_b / "dags" / DAG_FILE.name)
    release = tmp_path / "release"
    # A logical date of its own, so the run id is new on the cluster (both Airflows derive it from the date).
    # After the DAG's start_date (no task instances before it), before now (a manual run waits for its run_after).
    logical = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=random.randrange(2 * 10**7))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")} | {
        "RAYSLICE_TEST_AIRFLOW_HOME": str(home_b)}
    b = subprocess.Popen([sys.executable, "-c", AIRFLOW_B, cluster.dashboard_url, cluster.token or "",
                          logical.isoformat(), str(release)], cwd=REPO, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    token = airflow.api_token()
    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as jobs, \
            httpx.Client(base_url=f"{airflow.url}/api/v2", timeout=60,
                         headers={"Authorization": f"Bearer {token}"}) as api:
        try:
            # B's step runs and holds its GPU share.
            held = wait_until(lambda: _holding(jobs, logical), timeout=480, interval=0.5)  # B migrates its DB first
            assert held, f"Airflow B's step did not start:\n{_finish(b, release)}"
            sid_b, run_id = held
            assert wait_until(lambda: _get(api, f"/dags/{DAG_ID}") is not None, timeout=180, interval=1)

            # A runs the same DAG, run id and task: try 1 fails, try 2 stops its task's earlier tries.
            resp = api.post(f"/dags/{DAG_ID}/dagRuns", json={"dag_run_id": run_id, "logical_date": logical.isoformat(),
                                                             "conf": {"mode": "fail_first"}})
            assert resp.status_code == 200, resp.text
            done = wait_until(lambda: _ti(api, run_id).get("state") in ("success", "failed"), timeout=300, interval=1)
            ti = _ti(api, run_id)
            assert done and ti["state"] == "success" and ti["try_number"] == 2, ti
            assert jobs.get(sid_b).status == JobStatus.RUNNING, f"A's retry stopped B's job {sid_b}"

            # `rayslice reap` against A: B's job is not A's, though A's task of that name has ended.
            report = asyncio.run(orphans.reap(cluster.dashboard_url, token=cluster.token, airflow_url=airflow.url,
                                              airflow_token=token, emit=lambda line: None))
            assert sid_b not in report.stopped and sid_b in report.other_deployments, report
            assert jobs.get(sid_b).status == JobStatus.RUNNING, f"reap stopped B's job {sid_b}"
            a_result = _xcom(api, run_id)
        finally:
            outcome = _finish(b, release)
        b_result = json.loads(outcome.split("AIRFLOW_B ", 1)[1]) if "AIRFLOW_B " in outcome else None
        assert b_result and b_result["state"] == "success" and b_result["try_number"] == 1, outcome[-3000:]
        assert jobs.get(sid_b).status == JobStatus.SUCCEEDED
        [b_value] = b_result["xcom"]
        assert b_value["value"] == "held" and a_result["value"] == "try 2"
        # Each Airflow's step has a checkpoint folder of its own, under its deployment's name.
        deployments = {(j.metadata or {}).get("deployment") for j in _task_jobs(jobs, run_id)}
        assert len(deployments) == 2 and None not in deployments, deployments
        assert a_result["checkpoint_dir"] and b_value["checkpoint_dir"]
        assert a_result["checkpoint_dir"] != b_value["checkpoint_dir"]


def _task_jobs(jobs: RayJobsClient, run_id: str) -> list:
    return jobs_of_task(jobs.list_jobs(), Owner(dag_id=DAG_ID, run_id=run_id, task_id="step"))


def _holding(jobs: RayJobsClient, logical: datetime) -> tuple[str, str] | None:
    """(submission id, run id) of B's running step, once it printed that it holds its share."""
    for job in jobs.list_jobs():
        meta = job.metadata or {}
        if meta.get("dag_id") == DAG_ID and logical.isoformat()[:19] in meta.get("run_id", "") \
                and job.status == JobStatus.RUNNING and "holding the slice" in jobs.logs(job.submission_id):
            return job.submission_id, meta["run_id"]
    return None


def _finish(b: subprocess.Popen, release: Path) -> str:
    release.touch()
    try:
        out, _ = b.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        b.kill()
        out, _ = b.communicate()
    return out




def _ti(api: httpx.Client, run_id: str) -> dict:
    return _get(api, f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/step") or {}


def _xcom(api: httpx.Client, run_id: str):
    entry = _get(api, f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/step/xcomEntries/return_value")
    assert entry is not None, f"no XCom for {DAG_ID}/{run_id}"
    value = entry["value"]
    return json.loads(value) if isinstance(value, str) else value
