"""The shared operator flow, run by real Airflow (`dag.test()`) against the real test cluster.

One DAG file in the tests' bundle holds a DAG per scenario; each scenario runs as few
Ray jobs as it can (the whole Airflow suite has to stay within minutes on 2 cores).
"""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap
import threading
import time
from datetime import UTC, datetime

import pytest
from rayslice.operators.step import is_templated
from rayslice.operators.tpu_slice import TpuSliceOperator

from rayslice.jobs_client import JobStatus, RayJobsClient
from rayslice.step import Owner, StepSpec
from rayslice.submission import submission_id, submit_step
from tests.airflow_env import load_dag_file, task_states, write_dag_file, xcom_values
from tests.conftest import TOTAL_TPU_CHIPS, wait_until

# A loaded 2-core machine can slow a multi-host step several-fold: a guard, not a budget.
pytestmark = pytest.mark.timeout(600)

DAGS = textwrap.dedent(
    '''
    """Scenarios for tests/operators/test_step.py."""
    from datetime import datetime, timedelta

    from airflow.sdk import DAG, Param

    from rayslice.operators.accelerator import AcceleratorOperator
    from rayslice.operators.tpu_slice import TpuSliceOperator

    START = datetime(2026, 1, 1)


    def fail_on_host1():
        import time

        import jax

        if jax.process_index() == 1:
            raise RuntimeError("boom on host 1")
        time.sleep(120)  # the peers are cancelled as soon as host 1 fails


    def crash_first_try(context):
        if context["ti"].try_number == 1:
            raise RuntimeError("simulated crash of the worker running try 1")


    def token():
        import os
        import uuid

        return {"pid": os.getpid(), "token": uuid.uuid4().hex}


    def sleep_long():
        import time

        print("sleeping", flush=True)
        time.sleep(300)


    with DAG("rt_fail", schedule=None, start_date=START):
        TpuSliceOperator(task_id="fail", tpu="v6e-16", python_callable=fail_on_host1, deferrable=True,
                         poll_interval=0.5)

    with DAG("rt_retry", schedule=None, start_date=START):
        AcceleratorOperator(task_id="step", accelerator="GPU", count=0.25, python_callable=token,
                            retries=1, retry_delay=timedelta(0), pre_execute=crash_first_try,
                            deferrable=True, poll_interval=0.5)

    with DAG("rt_kill", schedule=None, start_date=START):
        TpuSliceOperator(task_id="sleep", tpu="v6e-16", python_callable=sleep_long, poll_interval=0.5)

    with DAG("rt_templated", schedule=None, start_date=START, params={"tpu": Param("v6e-4", type="string")}):
        TpuSliceOperator(task_id="step", tpu="{{ params.tpu }}", python_callable=token)
    '''
)


def sleeper(seconds: float = 300):
    import time

    print("try 1 still running", flush=True)
    time.sleep(seconds)


@pytest.fixture(scope="module")
def dags(airflow_db, ray_default):
    dags, errors = load_dag_file(write_dag_file("rt_scenarios", DAGS))
    assert not errors
    return dags


@pytest.fixture
def jobs(ray_default):
    with RayJobsClient(ray_default.dashboard_url, token=ray_default.token) as client:
        yield client


def sid_of(dag_run, task_id: str, try_number: int) -> str:
    return submission_id(Owner(dag_id=dag_run.dag_id, run_id=dag_run.run_id, task_id=task_id,
                               try_number=try_number))


def test_templated_values_are_checked_at_run_time_not_parse_time():
    assert is_templated("{{ params.tpu }}") and not is_templated("v6e-16")
    op = TpuSliceOperator(task_id="t", tpu="{{ params.tpu }}", entrypoint="pkg.mod:fn")
    assert op.tpu == "{{ params.tpu }}"


def test_a_bad_rendered_value_fails_before_anything_is_submitted(dags, jobs, capfd):
    dr = dags["rt_templated"].test(run_conf={"tpu": "v6e-15"})
    out = capfd.readouterr().out
    assert task_states(dr) == {"step": "failed"}
    assert "'v6e-15' is not a v6e slice" in out
    assert sid_of(dr, "step", 1) not in {j.submission_id for j in jobs.list_jobs()}


def test_a_failing_host_fails_the_task_with_its_error(dags, jobs, ray_default, capfd):
    dr = dags["rt_fail"].test()  # deferrable: the trigger follows the job, execute_complete fails it
    out = capfd.readouterr().out
    assert task_states(dr) == {"fail": "failed"}
    assert "step failed on v6e-16-" in out and "/host1 (slice 0, worker 1" in out
    assert "RuntimeError: boom on host 1" in out
    sid = sid_of(dr, "fail", 1)
    assert xcom_values(dr, "fail", key="ray_submission_id") == [sid]
    assert xcom_values(dr, "fail", key="_link_RayJobLink") == [f"{ray_default.dashboard_url}/#/jobs/{sid}"]
    assert jobs.get(sid_of(dr, "fail", 1)).status == JobStatus.FAILED


async def _submit_as_try_1_async(cluster, dag_run_owner: Owner) -> str:
    from rayslice.accelerators import AcceleratorRequest
    from rayslice.jobs_client import AsyncRayJobsClient

    spec = StepSpec.for_function(sleeper, request=AcceleratorRequest(resource="GPU", count=0.25),
                                 owner=dag_run_owner)
    async with AsyncRayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
        return await submit_step(client, spec)


def test_a_retry_stops_the_previous_try_and_a_rerun_reattaches(dags, jobs, ray_default):
    dag = dags["rt_retry"]
    when = datetime.now(UTC)  # fixed run_after: both runs below get the same run_id
    run_id = f"manual__{when.isoformat()}"
    try1 = asyncio.run(_submit_as_try_1_async(ray_default, Owner(dag_id="rt_retry", run_id=run_id, task_id="step",
                                                                 try_number=1)))
    assert wait_until(lambda: jobs.get(try1).status == JobStatus.RUNNING, timeout=60)

    # try 1's worker "crashes" (pre_execute), Airflow retries: try 2 stops try 1's job, then submits.
    dr = dag.test(logical_date=when, run_after=when)
    assert dr.run_id == run_id and task_states(dr) == {"step": "success"}
    try2 = sid_of(dr, "step", 2)
    first, second = jobs.get(try1), jobs.get(try2)
    assert first.status == JobStatus.STOPPED
    assert first.end_time <= second.start_time
    [result] = xcom_values(dr, "step")

    # The same try again (a restarted worker): it reattaches to its finished job, no new job.
    dr = dag.test(logical_date=when, run_after=when)
    assert task_states(dr) == {"step": "success"}
    assert xcom_values(dr, "step") == [result]
    ids = [j.submission_id for j in jobs.list_jobs()]
    assert ids.count(try1) == 1 and ids.count(try2) == 1


def test_on_kill_stops_the_job_and_frees_every_chip(dags, jobs, ray_driver, capfd):
    """SIGTERM to the task process (what Airflow sends to kill a task) runs on_kill."""
    dag = dags["rt_kill"]
    when = datetime.now(UTC)
    sid = submission_id(Owner(dag_id="rt_kill", run_id=f"manual__{when.isoformat()}", task_id="sleep",
                              try_number=1))
    killed = threading.Event()

    def kill_when_running():
        def running():
            try:
                return "sleeping" in jobs.logs(sid)
            except Exception:
                return False

        if wait_until(running, timeout=120, interval=0.2):
            killed.set()
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    killer = threading.Thread(target=kill_when_running, daemon=True)
    killer.start()
    try:
        dr = dag.test(logical_date=when, run_after=when)
    finally:
        killer.join(timeout=5)
        signal.signal(signal.SIGTERM, previous)
    stopped_at = time.monotonic()
    assert killed.is_set(), capfd.readouterr().out[-3000:]
    assert task_states(dr) == {"sleep": "failed"}
    assert wait_until(lambda: jobs.get(sid).status == JobStatus.STOPPED, timeout=5)
    free = wait_until(lambda: ray_driver.available_resources().get("TPU") == TOTAL_TPU_CHIPS, timeout=5)
    assert free, f"TPU chips still busy {time.monotonic() - stopped_at:.1f} s after on_kill"
    assert "stopped Ray job" in capfd.readouterr().out
