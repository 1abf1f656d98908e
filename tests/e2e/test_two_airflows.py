"""Two Airflows on one Ray cluster keep to their own jobs, checkpoint folders and cloud resources (issue 26,
item 7; issue 38, ownership).

Staging and prod with the same DAGs and run ids: the same (dag, run, task) runs in both. Airflow B
is `dag.test()` in its own AIRFLOW_HOME and metadata DB (a subprocess); Airflow A is the session's
real stack (B's DB is a copy of a freshly migrated one, so B does not pay for a migration). B's step
holds a quarter GPU; A's try 1 of the same task fails and its try 2, which stops the earlier tries of
its task, must not stop B's job; nor may `rayslice reap` against A.
Each gets its own checkpoint folder. Both also create the same-named RayCluster through one fake
Kubernetes API server (HTTP): B's comes first, and A neither adopts it on the name clash nor deletes
it or its token Secret in its teardown; B's own teardown deletes both.
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
from rayslice.cloud.kuberay_client import OWNER_ANNOTATION
from rayslice.core.step import Owner
from tests.airflow_cli import get_json as _get
from tests.airflow_env import migrated_db
from tests.conftest import wait_until
from tests.fake_kubernetes import FakeKubernetes

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "sc_twin"
DAG_FILE = REPO / "tests/e2e/dags/shared_cluster.py"

pytestmark = pytest.mark.timeout(900)

#: Airflow B: `dag.test()` of the same DAG file in a private AIRFLOW_HOME; prints the outcome as JSON.
AIRFLOW_B = textwrap.dedent("""
    import json, sys
    from datetime import datetime
    from tests import airflow_env as env

    if not (env.HOME / "airflow.db").exists():  # the test gives B a migrated DB of its own (`migrated_db`)
        env.init_db()
    env.use_cluster(sys.argv[1], sys.argv[2] or None)
    dags, errors = env.load_dag_file(env.TEST_DAGS / "shared_cluster.py")
    assert not errors, errors
    when = datetime.fromisoformat(sys.argv[3])
    dr = dags["sc_twin"].test(logical_date=when, run_after=when,  # run id: manual__<when>
                              run_conf={"mode": "hold", "release": sys.argv[4]})
    ti = env.task_instance(dr, "step")
    print("AIRFLOW_B " + json.dumps({"run_id": dr.run_id, "state": str(ti.state), "try_number": ti.try_number,
                                     "xcom": env.xcom_values(dr, "step"), "tasks": env.task_states(dr),
                                     "cluster_delete": env.xcom_values(dr, "cluster_delete")}))
""")


def test_two_airflows_with_the_same_task_keep_to_their_own_jobs(airflow, cluster, tmp_path, reference_crds):
    with FakeKubernetes(crds=reference_crds) as kube:
        _two_airflows(airflow, cluster, tmp_path, kube)


def _two_airflows(airflow, cluster, tmp_path, kube: FakeKubernetes):
    kuberay = {"conn_type": "ray", "extra": {"kuberay": {
        "namespace": "ml", "name": "rs", "kubeconfig": str(kube.write_kubeconfig(tmp_path / "kubeconfig"))}}}
    home_b = tmp_path / "airflow-b"
    (home_b / "dags").mkdir(parents=True)
    shutil.copy(DAG_FILE, home_b / "dags" / DAG_FILE.name)
    migrated_db(home_b / "airflow.db")
    release = tmp_path / "release"
    # A logical date of its own, so the run id is new on the cluster (both Airflows derive it from the date).
    # After the DAG's start_date (no task instances before it), before now (a manual run waits for its run_after).
    logical = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=random.randrange(2 * 10**7))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")} | {
        "RAYSLICE_TEST_AIRFLOW_HOME": str(home_b), "AIRFLOW_CONN_KUBERAY_TWIN": json.dumps(kuberay)}
    b = subprocess.Popen([sys.executable, "-c", AIRFLOW_B, cluster.dashboard_url, cluster.token or "",
                          logical.isoformat(), str(release)], cwd=REPO, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    token = airflow.api_token()
    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as jobs, \
            httpx.Client(base_url=f"{airflow.url}/api/v2", timeout=60,
                         headers={"Authorization": f"Bearer {token}"}) as api:
        resp = api.post("/connections", json={"connection_id": "kuberay_twin", "conn_type": "ray",
                                               "extra": json.dumps(kuberay["extra"])})
        assert resp.status_code in (201, 409), resp.text
        try:
            # B's step runs and holds its GPU share; its RayCluster is made.
            held = wait_until(lambda: _holding(jobs, logical), timeout=480, interval=0.5)  # B migrates its DB first
            assert held, f"Airflow B's step did not start:\n{_finish(b, release)}"
            sid_b, run_id = held
            assert wait_until(lambda: _get(api, f"/dags/{DAG_ID}") is not None, timeout=180, interval=1)

            # A runs the same DAG, run id and task: try 1 fails, try 2 stops its task's earlier tries.
            resp = api.post(f"/dags/{DAG_ID}/dagRuns", json={"dag_run_id": run_id, "logical_date": logical.isoformat(),
                                                             "conf": {"mode": "fail_first"}})
            assert resp.status_code == 200, resp.text
            done = wait_until(lambda: _ti(api, run_id, "cluster_delete").get("state") in ("success", "failed"),
                              timeout=300, interval=1)
            ti = _ti(api, run_id)
            assert done and ti["state"] == "success" and ti["try_number"] == 2, ti
            assert jobs.get(sid_b).status == JobStatus.RUNNING, f"A's retry stopped B's job {sid_b}"

            # A's RayCluster of the same name: B's is there, so A's setup fails and its teardown leaves B's alone.
            [deployment_b] = {(j.metadata or {}).get("deployment") for j in _task_jobs(jobs, run_id)
                              if j.submission_id == sid_b}
            theirs = kube.cluster("ml", "rs")
            assert theirs and theirs["metadata"]["annotations"][OWNER_ANNOTATION] == f"{deployment_b}/{DAG_ID}/{run_id}"
            assert _ti(api, run_id, "cluster_create")["state"] == "failed"
            assert _xcom(api, run_id, "cluster_delete") == "not-owned"
            assert ("ml", "rs-ray-token") in kube.secrets
            assert not [r for r in kube.requests if r[0] == "DELETE"], "A deleted B's RayCluster or its Secret"

            # `rayslice reap` against A: B's job is not A's, though A's task of that name has ended.
            report = asyncio.run(orphans.reap(cluster.dashboard_url, token=cluster.token, airflow_url=airflow.url,
                                              airflow_token=token, emit=lambda line: None))
            assert sid_b not in report.stopped and sid_b in report.other_deployments, report
            assert jobs.get(sid_b).status == JobStatus.RUNNING, f"reap stopped B's job {sid_b}"
            a_result = _xcom(api, run_id)
        finally:
            outcome = _finish(b, release)
            api.delete("/connections/kuberay_twin")
        b_result = json.loads(outcome.split("AIRFLOW_B ", 1)[1]) if "AIRFLOW_B " in outcome else None
        assert b_result and b_result["state"] == "success" and b_result["try_number"] == 1, outcome[-3000:]
        assert jobs.get(sid_b).status == JobStatus.SUCCEEDED
        assert b_result["tasks"]["cluster_create"] == "success" and b_result["cluster_delete"] == ["deleted"]
        assert kube.cluster("ml", "rs") is None and not kube.secrets  # B's teardown removed its own
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




def _ti(api: httpx.Client, run_id: str, task: str = "step") -> dict:
    return _get(api, f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task}") or {}


def _xcom(api: httpx.Client, run_id: str, task: str = "step"):
    entry = _get(api, f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task}/xcomEntries/return_value")
    assert entry is not None, f"no XCom for {DAG_ID}/{run_id}"
    value = entry["value"]
    try:
        return json.loads(value) if isinstance(value, str) else value
    except ValueError:  # a plain string ("not-owned")
        return value
