"""Submission ids: who reattaches to a job, who gets a fresh one, and which earlier tries a retry stops.

The id rules are pure functions; the round trips run real Ray jobs (a quarter GPU each) on the test cluster.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid

import pytest

from rayslice.client.jobs_client import AsyncRayJobsClient, JobDetails, JobStatus, RayJobsClient
from rayslice.client.submission import (
    ADHOC_PREFIX,
    jobs_of_task,
    owner_of,
    run_step_job,
    running_earlier_tries,
    submission_id,
    submit_step,
)
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.exceptions import SubmissionConflictError
from rayslice.core.step import Owner, StepSpec

QUARTER_GPU = AcceleratorRequest(resource="GPU", count=0.25)
TASK = Owner(dag_id="train", run_id="manual__2026-01-01T00:00:00+00:00", task_id="fit", map_index=2)


def first_step():
    return "first"


def second_step():
    return "second"


def fresh_token():
    import uuid

    return uuid.uuid4().hex


def a_try(try_number: int, ti_id: str | None = None, **fields) -> Owner:
    return TASK.model_copy(update={"try_number": try_number, "ti_id": ti_id or str(uuid.uuid4()), **fields})


def job_of(owner: Owner, status: JobStatus = JobStatus.RUNNING, **metadata: str) -> JobDetails:
    """A job as the dashboard lists it, with the metadata `submit_step` gives it."""
    sid = owner.submission_id or submission_id(owner)
    meta = {"rayslice": "1", "request": "GPU x0.25",
            **{k: str(v) for k, v in owner.model_dump().items() if k != "submission_id"}, **metadata}
    return JobDetails(status=status, submission_id=sid, metadata=meta)


# ---------------------------------------------------------------- the id rules


def test_an_airflow_try_always_finds_the_same_id_and_no_other_try_finds_it():
    ti_id = str(uuid.uuid4())
    sid = submission_id(a_try(2, ti_id))
    assert sid == submission_id(a_try(2, ti_id))  # a resumed deferral, a restarted worker
    assert sid.startswith("rayslice-train--fit-m2-") and "-try2-" in sid
    # A re-created run (same run_id, try numbers start again) or another Airflow: a new task-instance id.
    assert submission_id(a_try(2)) != sid


def test_a_step_without_a_task_instance_gets_a_fresh_id_every_time():
    ids = {submission_id(Owner()) for _ in range(3)} | {submission_id(TASK.model_copy(update={"try_number": 1}))}
    assert len(ids) == 4 and all(sid.startswith(ADHOC_PREFIX) for sid in ids)


def test_the_owner_reads_back_from_the_metadata_and_other_jobs_have_none():
    owner = a_try(3)
    job = job_of(owner)
    assert owner_of(job) == owner.model_copy(update={"submission_id": job.submission_id})
    assert owner_of(JobDetails(status=JobStatus.RUNNING, submission_id="raysubmit_1", metadata={"x": "1"})) is None
    assert owner_of(job_of(owner, try_number="three")) is None


def test_a_new_try_finds_every_earlier_try_still_running_by_metadata():
    try1, try2, try3 = a_try(1), a_try(2), a_try(3)
    jobs = [
        job_of(try1),                                                  # stop: try 1 still runs
        job_of(try2, JobStatus.PENDING),                               # stop: try 2 waits for capacity
        job_of(a_try(2), JobStatus.FAILED),                            # ended already
        job_of(try3),                                                  # this try itself
        job_of(a_try(1, map_index=3)),                                 # another mapped instance
        job_of(a_try(1, run_id="scheduled__2026-01-02T00:00:00+00:00")),  # another run
        JobDetails(status=JobStatus.RUNNING, submission_id="raysubmit_7", metadata=None),  # not ours
    ]
    assert running_earlier_tries(jobs, try3) == {jobs[0].submission_id: 1, jobs[1].submission_id: 2}
    assert running_earlier_tries(jobs, try1) == {}
    assert [j.submission_id for j in jobs_of_task(jobs, TASK)] == [j.submission_id for j in jobs[:4]]


def test_another_airflow_deployments_task_of_the_same_name_is_not_an_earlier_try():
    """Staging and prod share a cluster, DAGs and run ids: each finds only its own deployment's tries."""
    prod = {"deployment": "prod"}
    try1_prod, try1_staging = a_try(1, **prod), a_try(1, deployment="staging")
    jobs = [job_of(try1_prod), job_of(try1_staging), job_of(a_try(1))]  # the last one: stamped by no deployment
    assert running_earlier_tries(jobs, a_try(2, **prod)) == {jobs[0].submission_id: 1}
    assert running_earlier_tries(jobs, a_try(2, deployment="staging")) == {jobs[1].submission_id: 1}
    assert [j.submission_id for j in jobs_of_task(jobs, TASK.model_copy(update=prod))] == [jobs[0].submission_id]
    assert len(jobs_of_task(jobs, TASK)) == 3  # no deployment named: a tool's view of every deployment
    assert owner_of(jobs[1]).deployment == "staging"


def test_a_cluster_without_the_installed_launcher_says_what_to_set():
    from rayslice.client.submission import outcome
    from rayslice.core.exceptions import StepFailedError

    job = JobDetails(status=JobStatus.FAILED, submission_id="s1", message=(
        "Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):\n"
        "/usr/bin/python: Error while finding module specification for 'rayslice.cluster' "
        "(ModuleNotFoundError: No module named 'rayslice')"))
    with pytest.raises(StepFailedError, match="set the `ray` connection's extra 'launcher' to 'shipped'"):
        outcome(job, "")


def test_the_reaper_counts_a_try_of_a_deleted_run_as_ended():
    """`rayslice reap`: Airflow reporting another task-instance id at the same try means the run was re-created."""
    from rayslice.client.orphans import task_has_ended

    owner = a_try(1)
    assert not task_has_ended(owner, {"id": owner.ti_id, "try_number": 1, "state": "running"})
    assert task_has_ended(owner, {"id": str(uuid.uuid4()), "try_number": 1, "state": "running"})
    assert task_has_ended(owner, {"id": owner.ti_id, "try_number": 2, "state": "running"})


def test_submit_step_tells_the_caller_when_it_reattached_rather_than_submitted():
    """A follower resumes an earlier one's log only for a job that existed (issue 52: a fresh one reads nothing)."""
    from rayslice.core.exceptions import JobNotFoundError

    owner = a_try(1)

    class Client:
        def __init__(self, existing):
            self.existing, self.submitted = existing, []

        async def get(self, sid):
            if self.existing is None:
                raise JobNotFoundError(sid)
            return self.existing

        async def ensure_package(self, package):
            return "gcs://pkg.zip"

        async def submit(self, entrypoint, **kwargs):
            self.submitted.append(kwargs["submission_id"])

    spec = StepSpec.for_function(first_step, request=QUARTER_GPU, owner=owner)
    for existing, told in ((None, []), (job_of(owner), [submission_id(owner)])):
        client, reattached = Client(existing), []
        asyncio.run(submit_step(client, spec, emit=lambda _: None,
                                on_reattach=lambda job, into=reattached: into.append(job.submission_id)))
        assert reattached == told and len(client.submitted) == (0 if existing else 1)


# ---------------------------------------------------------------- real jobs


def test_owner_less_steps_run_one_after_another_each_return_their_own_result(cluster):
    lines: list[str] = []
    first = asyncio.run(run_step_job(cluster.dashboard_url, StepSpec.for_function(first_step, request=QUARTER_GPU),
                                     token=cluster.token, emit=lines.append))
    second = asyncio.run(run_step_job(cluster.dashboard_url, StepSpec.for_function(second_step, request=QUARTER_GPU),
                                      token=cluster.token, emit=lines.append))
    assert (first, second) == ("first", "second")
    submitted = [line for line in lines if line.startswith("[rayslice] submitted GPU x0.25 as Ray job ")]
    assert len(submitted) == 2 and len(set(submitted)) == 2 and not any("reattaching" in line for line in lines)
    assert all(ADHOC_PREFIX in line for line in submitted)


def test_an_explicit_submission_id_reattaches_its_own_job_and_refuses_anyone_elses(cluster):
    sid = f"test-explicit-{uuid.uuid4().hex[:12]}"
    spec = StepSpec.for_function(fresh_token, request=QUARTER_GPU)
    lines: list[str] = []
    first = asyncio.run(run_step_job(cluster.dashboard_url, spec, token=cluster.token, submission_id=sid,
                                     emit=lines.append))
    again = asyncio.run(run_step_job(cluster.dashboard_url, spec, token=cluster.token, submission_id=sid,
                                     emit=lines.append))
    assert again == first  # the same job's result: the step did not run twice
    assert f"[rayslice] reattaching to Ray job {sid} that this caller submitted (SUCCEEDED)" in lines
    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
        assert [j.submission_id for j in client.list_jobs()].count(sid) == 1

    async def submit_as_an_airflow_try() -> str:
        taken = StepSpec.for_function(fresh_token, request=QUARTER_GPU, owner=a_try(1, submission_id=sid))
        async with AsyncRayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
            return await submit_step(client, taken)

    with pytest.raises(SubmissionConflictError) as info:
        asyncio.run(submit_as_an_airflow_try())
    assert str(info.value).startswith(f"Ray job {sid} already exists and belongs to an ad-hoc step, "
                                      "not to Airflow task train.fit[2] of run manual__")
    assert "Leave the submission id empty to get a fresh one" in str(info.value)


def where_it_runs():
    import os

    import ray

    return {"runtime_env": ray.get_runtime_context().runtime_env, "rayslice": __import__("rayslice").__file__,
            "cwd": os.getcwd()}


def another_copy(tmp_path):
    """The launcher zips of a copy of this rayslice with one byte more (a comment): another digest."""
    from pathlib import Path

    import rayslice
    from rayslice.client import submission
    from rayslice.client.jobs_client import zip_directory
    from rayslice.core import launcher as launcher_files

    copy = shutil.copytree(Path(rayslice.__file__).parent, tmp_path / "rayslice",
                           ignore=shutil.ignore_patterns("__pycache__"))
    gang = copy / "cluster" / "gang.py"
    gang.write_text(gang.read_text() + "# another copy\n")
    return (zip_directory(copy, include=launcher_files.is_cluster_side, include_parent_dir=True),
            submission.launcher_packages()[1])


@pytest.mark.parametrize("launcher", ["shipped", "shipped, another copy", "installed"])
def test_hosts_start_without_a_runtime_env_where_the_cluster_has_the_same_launcher(cluster, launcher, monkeypatch,
                                                                                     tmp_path):
    """Every local node is labelled with its installed launcher's digest: a shipped launcher with the same
    digest starts its host without a runtime env, just as an installed one; another copy ships to it."""
    from rayslice.client import submission

    if launcher == "shipped, another copy":
        packages = another_copy(tmp_path)
        monkeypatch.setattr(submission, "launcher_packages", lambda: packages)
    spec = StepSpec.for_function(where_it_runs, request=QUARTER_GPU, launcher=launcher.split(",")[0])
    sid = f"test-launcher-{launcher.split(',')[0]}-{uuid.uuid4().hex[:8]}"
    host = asyncio.run(run_step_job(cluster.dashboard_url, spec, token=cluster.token, submission_id=sid,
                                    emit=lambda _: None))
    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
        job = client.get(sid)
    assert set(job.runtime_env or {}) >= {"working_dir", "env_vars"}  # spec.json and the driver's log setting
    assert ("py_modules" in job.runtime_env) == launcher.startswith("shipped")
    if launcher == "shipped, another copy":
        assert set(host["runtime_env"]) == {"py_modules"}  # the launcher alone: not the job's spec or variables
        assert "/runtime_resources/" in host["rayslice"]
    else:
        assert host["runtime_env"] == {}  # no setup_worker step for the host process
        assert "/runtime_resources/" not in host["rayslice"]  # the cluster's own copy
    # Its own folder, not the raylet's (shared by every step on the node), gone when the step ends.
    assert os.path.basename(host["cwd"]).startswith("rayslice-step-") and not os.path.exists(host["cwd"])


def test_an_installed_launcher_of_another_version_is_refused_before_anything_is_reserved(cluster):
    from rayslice import __version__
    from rayslice.core.exceptions import InvalidRequestError

    spec = StepSpec.for_function(first_step, request=QUARTER_GPU, launcher="installed", rayslice_version="0.0.1")
    lines: list[str] = []
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(run_step_job(cluster.dashboard_url, spec, token=cluster.token, emit=lines.append))
    message = str(info.value)
    assert f"submitted by rayslice 0.0.1 to run on the rayslice installed on the cluster, which is {__version__}" \
        in message
    assert not any("waiting for capacity" in line or "running on" in line for line in lines), lines  # stopped first
    assert "install rayslice==0.0.1 in the cluster's image, or set the `ray` connection's extra 'launcher' to " \
           "'shipped'" in message


def prints_marker_lines():
    """Echoes what another job's log, or its own input, could hold: marker lines that are not the driver's."""
    print('copied from another job: ::rayslice-result::"spoofed"')
    print('::rayslice-result::"spoofed at the start of a host line"')
    print('::rayslice-error::{"type": "StepFailedError", "message": "a printed error line"}')
    print("::rayslice-result::not json")
    print("::rayslice-error::{not json either")
    print('progress 50%\r::rayslice-result::"after a carriage return"')
    return "its own value"


@pytest.mark.parametrize("request_", [TpuSliceRequest(tpu="v6e-4"), QUARTER_GPU], ids=["v6e-4", "quarter-gpu"])
def test_marker_lines_a_step_prints_are_relayed_as_text_and_the_step_returns_its_own_value(cluster, request_):
    lines: list[str] = []
    spec = StepSpec.for_function(prints_marker_lines, request=request_)
    result = asyncio.run(run_step_job(cluster.dashboard_url, spec, token=cluster.token, emit=lines.append))
    assert result == (["its own value"] if isinstance(request_, TpuSliceRequest) else "its own value")
    relayed = "\n".join(lines)
    for text in ('copied from another job: ::rayslice-result::"spoofed"', "::rayslice-result::not json",
                 '::rayslice-error::{"type": "StepFailedError", "message": "a printed error line"}'):
        assert text in relayed, lines


def _quarter_gpu_id():
    import os

    return os.environ["CUDA_VISIBLE_DEVICES"]


def test_run_blocks_and_returns_the_steps_value(cluster, monkeypatch):
    import rayslice

    monkeypatch.setenv("RAYSLICE_DASHBOARD_URL", cluster.dashboard_url)
    if cluster.token:
        monkeypatch.setenv("RAYSLICE_RAY_TOKEN", cluster.token)
    lines: list[str] = []
    value = rayslice.run(_quarter_gpu_id, request=AcceleratorRequest(resource="GPU", count=0.25), emit=lines.append)
    assert value in ("0", "1", "2"), value  # one of the cluster's 3 logical GPUs
    assert any("capacity released" in line for line in lines), lines[-10:]


def test_run_says_what_it_needs(monkeypatch):
    import rayslice
    from rayslice.core.exceptions import InvalidRequestError

    monkeypatch.delenv("RAYSLICE_DASHBOARD_URL", raising=False)
    with pytest.raises(InvalidRequestError, match="RAYSLICE_DASHBOARD_URL"):
        rayslice.run(_quarter_gpu_id, request=AcceleratorRequest(resource="GPU", count=0.25))
    with pytest.raises(InvalidRequestError, match="needs request="):
        rayslice.run(_quarter_gpu_id, address="http://127.0.0.1:1")
    spec = StepSpec.for_function(_quarter_gpu_id, request=AcceleratorRequest(resource="GPU", count=0.25))
    with pytest.raises(InvalidRequestError, match="takes the StepSpec as it is"):
        rayslice.run(spec, address="http://127.0.0.1:1", kwargs={"x": 1})
