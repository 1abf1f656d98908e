"""Cluster sets under faults (issue 53, found by two reviews): defects found by trying to break `run_on_set`,
cluster-free.

The members' Jobs clients are fakes; the claims folder is a real local folder, as the standbys read it.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from rayslice.client import cluster_set
from rayslice.client.cluster_set import Member, run_on_set, spec_for_set
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.cluster_claim import Claims
from rayslice.core.context import checkpoint_dir_for
from rayslice.core.exceptions import RanElsewhereError, RayJobsError, StepFailedError, UnsatisfiableRequestError
from rayslice.core.step import Owner, StepSpec


class FakeClient:
    """A member's Jobs client: reachable; `stop` records what it stopped."""

    def __init__(self) -> None:
        self.stopped: list[str] = []

    async def version(self) -> dict:
        return {"ray_version": "2.60.0"}

    async def stop(self, sid: str) -> bool:
        self.stopped.append(sid)
        return True


def _set_spec(tmp_path):
    spec = StepSpec.for_function(len, request=TpuSliceRequest(tpu="v6e-4"), checkpoint_root=f"file://{tmp_path}",
                                 owner=Owner(dag_id="d", run_id="r", task_id="t", try_number=1, ti_id="ti-1"))
    spec = spec_for_set(spec, "tpus", ("a", "b"), shared_root=True)
    return spec, checkpoint_dir_for(spec.checkpoint_root, spec.owner)


def test_a_holder_that_dies_during_a_storage_blip_fails_the_step_instead_of_hanging(tmp_path, monkeypatch):
    spec, folder = _set_spec(tmp_path)
    sid = spec.owner.submission_id
    # a admitted the step and claimed generation 0; then its driver was killed (no `released`, no `done`).
    assert Claims(folder, member="a", submission_id=sid).take().held_by("a", sid)

    async def submit(client, mine, emit=print):
        return sid

    async def follow(client, job_sid, emit=print):
        if client is clients["a"]:
            await asyncio.sleep(0.2)
            raise StepFailedError("Ray job failed: the driver was killed (exit code -9)")
        # b's launcher, as `SetMember.stand_by` does: out of its queue until the claim is released or done.
        standby = Claims(folder, member="b", submission_id=sid)
        while True:
            state = standby.state()
            if state.done is not None:
                raise RanElsewhereError("cluster a ran this step; b stood by")
            if state.holder is None:
                return "b ran it"
            await asyncio.sleep(0.05)

    reads = {"n": 0}
    real_state = cluster_set._claims_state

    def flaky_state(spec_):
        reads["n"] += 1
        if reads["n"] == 1:  # one 503 from the store: the very read that decides whether a's failure is the step's
            raise OSError("503 Service Unavailable")
        return real_state(spec_)

    clients = {"a": FakeClient(), "b": FakeClient()}
    monkeypatch.setattr(cluster_set, "submit_step", submit)
    monkeypatch.setattr(cluster_set, "wait_for_step", follow)
    monkeypatch.setattr(cluster_set, "_claims_state", flaky_state)
    members = [Member(name, client) for name, client in clients.items()]

    async def main():
        return await asyncio.wait_for(run_on_set(spec, members, emit=lambda line: None), timeout=10)

    with pytest.raises(StepFailedError, match="driver was killed"):
        asyncio.run(main())


def test_a_submission_that_fails_on_one_member_never_leaves_the_others_job_unfollowed(tmp_path, monkeypatch):
    from rayslice.core.exceptions import SubmissionConflictError

    spec, _ = _set_spec(tmp_path)
    sid = spec.owner.submission_id
    clients = {"a": FakeClient(), "b": FakeClient()}
    submitted: list[str] = []

    async def submit(client, mine, emit=print):
        if client is clients["a"]:
            await asyncio.sleep(0.05)  # b's submission went through first
            raise SubmissionConflictError(f"Ray job {sid} exists on this cluster and belongs to another task")
        submitted.append("b")
        return sid

    async def follow(client, job_sid, emit=print):
        return "b ran it"

    monkeypatch.setattr(cluster_set, "submit_step", submit)
    monkeypatch.setattr(cluster_set, "wait_for_step", follow)
    members = [Member(name, client) for name, client in clients.items()]
    try:
        result = asyncio.run(asyncio.wait_for(run_on_set(spec, members, emit=lambda line: None), timeout=10))
    except SubmissionConflictError:
        result = None
    assert submitted == ["b"]
    assert result == "b ran it" or clients["b"].stopped == [sid], \
        "b's job was submitted, then neither followed nor stopped"


async def _stand_by(folder: str, member: str, sid: str):
    """A member's launcher as `SetMember.stand_by` runs: out of its queue until the step ends elsewhere."""
    standby = Claims(folder, member=member, submission_id=sid)
    while True:
        state = standby.state()
        if state.done is not None:
            raise RanElsewhereError(f"cluster {state.done.get('cluster')} ran this step; {member} stood by")
        await asyncio.sleep(0.05)


def test_a_member_whose_submission_failed_after_its_job_was_created_is_not_lost(tmp_path, monkeypatch):
    spec, folder = _set_spec(tmp_path)
    sid = spec.owner.submission_id
    clients = {"a": FakeClient(), "b": FakeClient()}

    def b_job_runs_the_step():  # b's job exists though its submission answered with an error: it claims and runs
        claims = Claims(folder, member="b", submission_id=sid)
        assert claims.take().held_by("b", sid)
        claims.finish("succeeded")

    tries = {"b": 0}

    async def submit(client, mine, emit=print):
        if client is clients["b"]:
            tries["b"] += 1
            if tries["b"] == 1:
                threading.Thread(target=b_job_runs_the_step).start()
                raise RayJobsError("POST /api/jobs/ timed out (the cluster got it)")
            # as submit_step does when asked again: the job of this id, this caller's, is reattached
        return sid

    async def follow(client, job_sid, emit=print):
        if client is clients["b"]:  # followed as any other member's job: it ran the step
            return "b ran it"
        return await _stand_by(folder, "a", sid)

    monkeypatch.setattr(cluster_set, "submit_step", submit)
    monkeypatch.setattr(cluster_set, "wait_for_step", follow)
    members = [Member(name, client) for name, client in clients.items()]
    try:
        result = asyncio.run(asyncio.wait_for(run_on_set(spec, members, emit=lambda line: None), timeout=20))
    except UnsatisfiableRequestError as exc:
        pytest.fail(f"the step ran (and succeeded) on cluster b, but the set says: {exc}")
    assert result == "b ran it"


def test_the_holders_failure_is_the_steps_error_even_when_every_job_ended_during_an_outage(tmp_path, monkeypatch):
    spec, folder = _set_spec(tmp_path)
    sid = spec.owner.submission_id
    clients = {"a": FakeClient(), "b": FakeClient()}
    a_done = threading.Event()

    async def submit(client, mine, emit=print):
        return sid

    async def follow(client, job_sid, emit=print):
        if client is clients["a"]:  # a's job dies before it claims (its runtime env never set up)
            await asyncio.sleep(0.1)
            a_done.set()
            raise StepFailedError("a: the runtime env could not be set up")
        while not a_done.is_set():
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        assert Claims(folder, member="b", submission_id=sid).take().held_by("b", sid)
        raise StepFailedError("b: the step raised ValueError")  # b held the step; its driver died before `done`

    reads = {"n": 0}
    real_state = cluster_set._claims_state

    def outage_then_back(spec_):  # the store fails the reads made as the two jobs fail, then answers again
        reads["n"] += 1
        if reads["n"] <= 3:
            raise OSError("503 Service Unavailable")
        return real_state(spec_)

    monkeypatch.setattr(cluster_set, "READ_TRIES", 1)
    monkeypatch.setattr(cluster_set, "submit_step", submit)
    monkeypatch.setattr(cluster_set, "wait_for_step", follow)
    monkeypatch.setattr(cluster_set, "_claims_state", outage_then_back)
    members = [Member(name, client) for name, client in clients.items()]
    with pytest.raises(StepFailedError) as raised:
        asyncio.run(asyncio.wait_for(run_on_set(spec, members, emit=lambda line: None), timeout=20))
    assert "b: the step raised" in str(raised.value), f"the step ran on b, but the task fails with: {raised.value}"


def test_a_member_whose_following_failed_and_that_claims_later_is_not_reported_failed_while_it_runs(
        tmp_path, monkeypatch):
    spec, folder = _set_spec(tmp_path)
    sid = spec.owner.submission_id
    clients = {"a": FakeClient(), "b": FakeClient()}
    a_running = threading.Event()

    def a_job():  # a's job lives on, out of the submitter's sight: admitted there, it claims and runs the step
        import time

        time.sleep(0.3)
        claims = Claims(folder, member="a", submission_id=sid)
        assert claims.take().held_by("a", sid)
        a_running.set()
        time.sleep(1.5)
        a_running.clear()
        claims.finish("succeeded")

    async def submit(client, mine, emit=print):
        return sid

    async def follow(client, job_sid, emit=print):
        if client is clients["a"]:
            await asyncio.sleep(0.1)  # the claims are read fine now: nobody holds the step
            raise RayJobsError("the Ray dashboard of cluster a was unreachable for 300 s; job may still be running")
        return await _stand_by(folder, "b", sid)

    monkeypatch.setattr(cluster_set, "RECHECK_S", 0.2)
    monkeypatch.setattr(cluster_set, "submit_step", submit)
    monkeypatch.setattr(cluster_set, "wait_for_step", follow)
    members = [Member(name, client) for name, client in clients.items()]
    job = threading.Thread(target=a_job)
    job.start()
    try:
        asyncio.run(asyncio.wait_for(run_on_set(spec, members, emit=lambda line: None), timeout=20))
    except RayJobsError:
        pass
    finally:
        still_running = a_running.is_set()
        job.join()
    assert not still_running or clients["a"].stopped == [sid], \
        "the task gave up on the step while a's job still ran it, and left that job running"
