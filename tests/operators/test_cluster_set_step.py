"""A task on a cluster-set connection, run by real Airflow (`dag.test()`) over two real local clusters.

The triggerer hands it to a worker (a set is followed on every member at once); it runs on the member that
admits it first, and its XCom is that member's result (rayslice/operators/step.py `_run_on_set`).
"""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
import threading
from datetime import UTC, datetime

import pytest

from rayslice.client.submission import run_step_job
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local.local_cluster import ray_connection
from tests.airflow_env import load_dag_file, write_dag_file, xcom_values
from tests.cluster_pair import NAMES
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(600)

DAGS = textwrap.dedent(
    '''
    """A step on the cluster set `tpus` (tests/operators/test_cluster_set_step.py)."""
    from datetime import datetime

    from airflow.sdk import DAG

    from rayslice.operators.tpu_slice import TpuSliceOperator


    def where():
        import ray

        return ray.get_runtime_context().gcs_address


    with DAG("set_step", schedule=None, start_date=datetime(2026, 1, 1)):
        TpuSliceOperator(task_id="step", tpu="v6e-4", python_callable=where, ray_conn_id="tpus", poll_interval=0.5)
    '''
)


@pytest.fixture(scope="module")
def set_connection(cluster_pair, airflow_db):
    """`set_a`, `set_b` (the two clusters) and `tpus`, the set of both, as Airflow connections."""
    a, b = (cluster_pair.records[n] for n in NAMES)
    os.environ["AIRFLOW_CONN_SET_A"] = json.dumps(ray_connection(a.dashboard_url, a.token))
    os.environ["AIRFLOW_CONN_SET_B"] = json.dumps(ray_connection(b.dashboard_url, b.token))
    os.environ["AIRFLOW_CONN_TPUS"] = json.dumps({"conn_type": "ray", "extra": {
        "clusters": ["set_a", "set_b"], "checkpoint_root": f"file://{cluster_pair.shared}", "shared_root": True}})
    yield cluster_pair
    for name in ("AIRFLOW_CONN_SET_A", "AIRFLOW_CONN_SET_B", "AIRFLOW_CONN_TPUS"):
        os.environ.pop(name, None)


def holder(flag: str) -> None:
    import time
    from pathlib import Path

    Path(flag).with_suffix(".started").write_text("")
    while not Path(flag).exists():
        time.sleep(0.1)


def test_a_task_on_a_set_runs_on_the_member_that_is_free_and_returns_its_result(set_connection, tmp_path):
    a, b = (set_connection.records[n] for n in NAMES)
    flag = tmp_path / "hold"
    spec = StepSpec.for_function(holder, request=TpuSliceRequest(tpu="v6e-4"), kwargs={"flag": str(flag)},
                                 owner=Owner(task_id="holder-of-a"), launcher="installed")
    held = threading.Thread(target=lambda: asyncio.run(run_step_job(a.dashboard_url, spec, token=a.token,
                                                                    emit=lambda line: None)))
    held.start()
    try:
        assert wait_until(lambda: flag.with_suffix(".started").exists(), timeout=120)
        dags, errors = load_dag_file(write_dag_file("set_step", DAGS))
        assert not errors, errors
        when = datetime.now(UTC)
        run = dags["set_step"].test(logical_date=when, run_after=when)
    finally:
        flag.write_text("go")
        held.join(120)
    assert str(run.state) == "success"
    assert xcom_values(run, "step") == [[b.gcs_address]]
    # Which member ran it, for the task's readers and its "Ray job" link: set_b's job, through the Slices plugin.
    [sid] = xcom_values(run, "step", key="ray_submission_id")
    assert xcom_values(run, "step", key="ray_cluster") == [{"submission_id": sid, "cluster": "set_b"}]
    assert xcom_values(run, "step", key="_link_RayJobLink") == [f"/rayslice/job/{sid}?conn_id=set_b"]


def test_a_retry_on_a_set_ends_the_earlier_tries_claims_so_their_queued_jobs_never_run(tmp_path):
    """Cluster-free: try 2 ends try 1's chain in the shared folder (try 1's job may wait in the queue of a cluster
    try 2 cannot reach, to stop it there); its own chain stays open."""
    from rayslice.operators.tpu_slice import TpuSliceOperator

    from rayslice.core.cluster_claim import Claims
    from rayslice.core.context import checkpoint_dir_for

    op = TpuSliceOperator(task_id="step", tpu="v6e-4", python_callable=holder, ray_conn_id="tpus")
    owner = Owner(dag_id="d", run_id="r", task_id="step", try_number=2, submission_id="try-2")
    spec = StepSpec.for_function(holder, request=TpuSliceRequest(tpu="v6e-4"), owner=owner,
                                 checkpoint_root=f"file://{tmp_path}")
    folder = checkpoint_dir_for(spec.checkpoint_root, owner)
    earlier = Claims(folder, member="set_a", submission_id="try-1")
    earlier.take()
    asyncio.run(op._end_earlier_chains(spec))
    assert earlier.state().done["superseded_by"] == "try-2"
    assert Claims(folder, member="set_b", submission_id="try-2").take().held_by("set_b", "try-2")
