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
import uuid
from datetime import UTC, datetime

import pytest
from rayslice.operators.step import is_templated
from rayslice.operators.tpu_slice import TpuSliceOperator

from rayslice.client.jobs_client import AsyncRayJobsClient, JobStatus, RayJobsClient
from rayslice.client.submission import jobs_of_task, submission_id, submit_step, wait_for_step
from rayslice.core.accelerators import AcceleratorRequest
from rayslice.core.exceptions import SubmissionConflictError
from rayslice.core.step import Owner, StepSpec
from tests.airflow_env import deployment, load_dag_file, task_instance, task_states, write_dag_file, xcom_values
from tests.conftest import TOTAL_TPU_CHIPS, wait_until

# A loaded 2-core machine can slow a multi-host step several-fold: a guard, not a budget.
pytestmark = pytest.mark.timeout(600)

DAGS = textwrap.dedent(
    '''
    """Scenarios for tests/operators/test_step.py."""
    from datetime import datetime, timedelta

    from airflow.sdk import DAG, Param
    from airflow.sdk.exceptions import AirflowFailException

    from rayslice.operators.accelerator import AcceleratorOperator
    from rayslice.operators.tpu_slice import TpuSliceOperator

    START = datetime(2026, 1, 1)


    def fail_on_host1():
        import time

        import jax

        if jax.process_index() == 1:
            raise RuntimeError("boom on host 1")
        time.sleep(120)  # the peers are cancelled as soon as host 1 fails


    def say_where(context):
        """An on_failure_callback reading the failure's structured fields, as a user's alerting would."""
        exc = context["exception"]
        print(f"failure: {type(exc).__name__} retried={not isinstance(exc, AirflowFailException)} "
              f"type={exc.error_type} slice={exc.slice_index} worker={exc.worker_id} host={exc.host} "
              f"exit={exc.exit_code} try={context['ti'].try_number}", flush=True)


    def crash_before_try_3(context):
        try_number = context["ti"].try_number
        if try_number < 3:
            raise RuntimeError(f"simulated crash of the worker running try {try_number}")


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
                         poll_interval=0.5, min_deferral=0,  # dag.test() has no scheduler to race
                         on_failure_callback=say_where)

    with DAG("rt_never", schedule=None, start_date=START):  # no NPU anywhere: no retry can help
        AcceleratorOperator(task_id="npu", accelerator="NPU", count=0.5, python_callable=token, retries=2,
                            retry_delay=timedelta(0), deferrable=True, poll_interval=0.5, min_deferral=0,
                            on_failure_callback=say_where)

    with DAG("rt_retry", schedule=None, start_date=START):
        AcceleratorOperator(task_id="step", accelerator="GPU", count=0.25, python_callable=token,
                            retries=2, retry_delay=timedelta(0), pre_execute=crash_before_try_3,
                            deferrable=True, poll_interval=0.5, min_deferral=0)

    with DAG("rt_rerun", schedule=None, start_date=START):
        AcceleratorOperator(task_id="step", accelerator="GPU", count=0.25, python_callable=token, poll_interval=0.5)

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


def task_jobs(jobs: RayJobsClient, dag_id: str, run_id: str, task_id: str) -> list:
    """Every rayslice job of a task instance, any try: found by metadata, as ids hold each try's TI id."""
    return jobs_of_task(jobs.list_jobs(), Owner(dag_id=dag_id, run_id=run_id, task_id=task_id))


def owner_of_ti(dag_run, task_id: str) -> Owner:
    """The Owner the operator builds for the task instance's current try."""
    ti = task_instance(dag_run, task_id)
    return Owner(dag_id=dag_run.dag_id, run_id=dag_run.run_id, task_id=task_id, try_number=ti.try_number,
                 deployment=deployment(), ti_id=str(ti.id))


def test_templated_values_are_checked_at_run_time_not_parse_time():
    assert is_templated("{{ params.tpu }}") and not is_templated("v6e-16")
    op = TpuSliceOperator(task_id="t", tpu="{{ params.tpu }}", callable="pkg.mod:fn")
    assert op.tpu == "{{ params.tpu }}"


def test_a_bad_rendered_value_fails_before_anything_is_submitted(dags, jobs, capfd):
    dr = dags["rt_templated"].test(run_conf={"tpu": "v6e-15"})
    out = capfd.readouterr().out
    assert task_states(dr) == {"step": "failed"}
    assert "'v6e-15' is not a v6e slice" in out
    assert task_jobs(jobs, "rt_templated", dr.run_id, "step") == []


def test_a_failing_host_fails_the_task_with_its_error(dags, jobs, ray_default, capfd):
    dr = dags["rt_fail"].test()  # deferrable: the trigger follows the job, execute_complete fails it
    out = capfd.readouterr().out
    assert task_states(dr) == {"fail": "failed"}
    assert "step failed on v6e-16-" in out and "/host1 (slice 0, worker 1" in out
    assert "RuntimeError: boom on host 1" in out
    # Where it failed reaches Airflow as fields of the task's exception, not only as words in its message.
    assert "failure: RayStepFailed retried=True type=StepFailedError slice=0 worker=1 host=127.0.0.2 exit=None" \
        in out, out[-3000:]
    sid = submission_id(owner_of_ti(dr, "fail"))  # the id holds the try's task-instance id, set under dag.test()
    assert sid.endswith("-try1-" + sid.rsplit("-", 1)[1]) and "rayslice-adhoc" not in sid
    assert xcom_values(dr, "fail", key="ray_submission_id") == [sid]
    # The link goes through the Slices plugin, which redirects only connection readers to the dashboard.
    assert xcom_values(dr, "fail", key="_link_RayJobLink") == [f"/rayslice/job/{sid}?conn_id=ray_default"]
    assert jobs.get(sid).status == JobStatus.FAILED


def test_a_request_no_node_can_hold_fails_once_without_retrying(dags, capfd):
    dr = dags["rt_never"].test()
    out = capfd.readouterr().out
    assert task_states(dr) == {"npu": "failed"}
    assert task_instance(dr, "npu").try_number == 1, "an unsatisfiable request was retried"
    assert "failure: RayStepFailedForGood retried=False type=UnsatisfiableRequestError" in out, out[-3000:]


async def _submit(cluster, owner: Owner, fn=sleeper, emit=print) -> str:
    spec = StepSpec.for_function(fn, request=AcceleratorRequest(resource="GPU", count=0.25), owner=owner)
    async with AsyncRayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
        return await submit_step(client, spec, emit=emit)


def test_a_retry_stops_every_earlier_try_that_still_runs(dags, jobs, ray_default, capfd):
    """Try 1's job outlived its worker; try 2 crashed before submitting; try 3 stops try 1's job, then runs."""
    dag = dags["rt_retry"]
    when = datetime.now(UTC)  # fixed run_after: we know the run_id before the run exists
    run_id = f"manual__{when.isoformat()}"
    try1 = asyncio.run(_submit(ray_default, Owner(dag_id="rt_retry", run_id=run_id, task_id="step", try_number=1,
                                                  deployment=deployment(), ti_id=str(uuid.uuid4()))))
    assert wait_until(lambda: jobs.get(try1).status == JobStatus.RUNNING, timeout=60)

    dr = dag.test(logical_date=when, run_after=when)  # tries 1 and 2 crash in pre_execute
    out = capfd.readouterr().out
    assert dr.run_id == run_id and task_states(dr) == {"step": "success"}
    assert task_instance(dr, "step").try_number == 3
    [try3] = xcom_values(dr, "step", key="ray_submission_id")
    assert try3 == submission_id(owner_of_ti(dr, "step"))
    first, third = jobs.get(try1), jobs.get(try3)
    assert first.status == JobStatus.STOPPED and third.status == JobStatus.SUCCEEDED
    assert first.end_time <= third.start_time
    assert f"stopping Ray job {try1} of try 1 before this try starts" in out
    assert sorted(j.submission_id for j in task_jobs(jobs, "rt_retry", run_id, "step")) == sorted([try1, try3])


def test_a_recreated_run_runs_its_own_step_and_only_the_same_try_reattaches(dags, jobs, ray_default, capfd):
    dag = dags["rt_rerun"]
    when = datetime.now(UTC)
    first = dag.test(logical_date=when, run_after=when)
    [first_result] = xcom_values(first, "step")
    [first_sid] = xcom_values(first, "step", key="ray_submission_id")

    # dag.test() again with the same logical date deletes the run and creates it again: the same run_id
    # and try 1 again, but a new task instance, so it runs its own step instead of inheriting the old result.
    second = dag.test(logical_date=when, run_after=when)
    out = capfd.readouterr().out
    assert second.run_id == first.run_id and task_states(second) == {"step": "success"}
    [second_result] = xcom_values(second, "step")
    [second_sid] = xcom_values(second, "step", key="ray_submission_id")
    assert second_sid != first_sid and second_result["token"] != first_result["token"]
    assert f"[rayslice] submitted GPU x0.25 as Ray job {second_sid}" in out and "reattaching" not in out
    ours = {j.submission_id: j.status for j in task_jobs(jobs, "rt_rerun", second.run_id, "step")}
    assert ours == {first_sid: JobStatus.SUCCEEDED, second_sid: JobStatus.SUCCEEDED}

    # The same try submitted again (a worker running it once more): it reattaches to its own job and
    # gets that job's result; the step given here never runs.
    owner = owner_of_ti(second, "step")
    lines: list[str] = []

    async def submit_again() -> tuple[str, object]:
        spec = StepSpec.for_function(sleeper, request=AcceleratorRequest(resource="GPU", count=0.25), owner=owner)
        async with AsyncRayJobsClient(ray_default.dashboard_url, token=ray_default.token) as client:
            sid = await submit_step(client, spec, emit=lines.append)
            return sid, await wait_for_step(client, sid, emit=lines.append)

    assert asyncio.run(submit_again()) == (second_sid, second_result)
    assert lines[0] == f"[rayslice] reattaching to Ray job {second_sid} that this try submitted (SUCCEEDED)"
    assert len(task_jobs(jobs, "rt_rerun", second.run_id, "step")) == 2

    # Another task instance naming that id is refused, not handed this try's result.
    stranger = owner.model_copy(update={"ti_id": str(uuid.uuid4()), "submission_id": second_sid})
    with pytest.raises(SubmissionConflictError, match=f"Ray job {second_sid} already exists and belongs to "
                                                      "Airflow task rt_rerun.step of run"):
        asyncio.run(_submit(ray_default, stranger))
    assert len(task_jobs(jobs, "rt_rerun", second.run_id, "step")) == 2


def test_on_kill_stops_the_job_and_frees_every_chip(dags, jobs, ray_driver, capfd):
    """SIGTERM to the task process (what Airflow sends to kill a task) runs on_kill."""
    dag = dags["rt_kill"]
    when = datetime.now(UTC)
    run_id = f"manual__{when.isoformat()}"
    killed = threading.Event()
    sids: list[str] = []

    def kill_when_running():
        def running():
            try:
                sids[:] = [j.submission_id for j in task_jobs(jobs, "rt_kill", run_id, "sleep")]
                return len(sids) == 1 and "sleeping" in jobs.logs(sids[0])
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
    [sid] = sids
    assert wait_until(lambda: jobs.get(sid).status == JobStatus.STOPPED, timeout=5)
    free = wait_until(lambda: ray_driver.available_resources().get("TPU") == TOTAL_TPU_CHIPS, timeout=5)
    assert free, f"TPU chips still busy {time.monotonic() - stopped_at:.1f} s after on_kill"
    assert "stopped Ray job" in capfd.readouterr().out


def sleep_long():
    import time

    print("sleeping", flush=True)
    time.sleep(300)


def test_every_deferral_has_a_deadline_from_the_steps_limits():
    from datetime import timedelta

    from rayslice.operators.step import ATTEMPT_MARGIN_S

    limits = {"task_id": "t", "tpu": "v6e-4", "python_callable": sleep_long, "capacity_timeout": 100}
    assert TpuSliceOperator(**limits, step_timeout=50, preemption_retries=1).deferral_limit() == (
        2 * (100 + 50 + ATTEMPT_MARGIN_S), "capacity_timeout + step_timeout (with a margin)")
    assert TpuSliceOperator(**limits, step_timeout=50, execution_timeout=timedelta(seconds=30)).deferral_limit() == (
        30, "execution_timeout")
    assert TpuSliceOperator(**limits).deferral_limit() == (None, "")  # no limit set: the step runs as long as it runs


def test_a_task_that_gives_up_on_its_deferral_stops_the_job(jobs, ray_default):
    """Airflow timed the deferral out (the task resumes as `__fail__`): the task stops its still-running job."""
    from types import SimpleNamespace

    from airflow.sdk.exceptions import TaskDeferralTimeout
    from rayslice.operators.accelerator import AcceleratorOperator

    ti = SimpleNamespace(dag_id="rt_give_up", run_id=f"r{time.time_ns()}", task_id="step", map_index=None,
                         try_number=1, id=uuid.uuid4())
    op = AcceleratorOperator(task_id="step", accelerator="GPU", count=0.25, python_callable=sleep_long,
                             deferrable=True)
    owner = op._owner({"ti": ti})
    spec = StepSpec.for_function(sleep_long, request=AcceleratorRequest(resource="GPU", count=0.25), owner=owner)

    async def submit() -> str:
        async with AsyncRayJobsClient(ray_default.dashboard_url, token=ray_default.token) as client:
            return await submit_step(client, spec, emit=lambda _: None)

    sid = asyncio.run(submit())
    try:
        assert wait_until(lambda: "sleeping" in jobs.logs(sid), timeout=180, interval=0.5)
        with pytest.raises(TaskDeferralTimeout):
            op.resume_execution("__fail__", {"error": "Trigger timeout"}, {"ti": ti})
        assert wait_until(lambda: jobs.get(sid).status == JobStatus.STOPPED, timeout=60, interval=0.5)
    finally:
        jobs.stop(sid)


def test_preemptible_and_notice_signal_reach_the_step_and_bad_values_fail_at_parse_time():
    from rayslice.operators.tpu_slice import TpuSliceOperator

    from rayslice.core.exceptions import InvalidRequestError

    op = TpuSliceOperator(task_id="train", tpu="v6e-16", command=["python", "train.py"], preemptible=True,
                          notice_signal="usr1", preemption_retries=2)
    assert (op.preemptible, op.notice_signal) == (True, "SIGUSR1")
    with pytest.raises(InvalidRequestError, match=r"notice_signal 'SIGKILL' .*task 'bad'"):
        TpuSliceOperator(task_id="bad", tpu="v6e-16", command=["true"], notice_signal="SIGKILL")
    with pytest.raises(InvalidRequestError, match="preemptible of 'bad2' must be True or False"):
        TpuSliceOperator(task_id="bad2", tpu="v6e-16", command=["true"], preemptible="yes")


EXECUTOR_RACE_DAG = textwrap.dedent('''
    from datetime import datetime

    from airflow.sdk import DAG, task

    with DAG("executor_race", start_date=datetime(2026, 1, 1), schedule=None):

        @task
        def inside():
            from rayslice.operators.step import _executor_can_race
            return _executor_can_race()

        inside()
''')


def test_dag_test_has_no_executor_to_race_so_a_deferred_step_resumes_at_once(airflow_db):
    """`min_deferral` waits out a worker's exit report; `dag.test()` runs the task in this process, without one."""
    from rayslice.operators.step import _executor_can_race

    assert _executor_can_race()  # not inside a task: assume an executor, keep the wait
    dags, errors = load_dag_file(write_dag_file("executor_race", EXECUTOR_RACE_DAG))
    assert not errors, errors
    dr = dags["executor_race"].test()
    assert task_states(dr) == {"inside": "success"}
    assert xcom_values(dr, "inside") == [False]
