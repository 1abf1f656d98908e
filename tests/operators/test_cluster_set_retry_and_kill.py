"""A set's step retried or killed while a member cannot be reached (issue 53, found by review), cluster-free: a fake
dashboard over real HTTP, and a port that refuses connections for the member that cannot be reached."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local.local_cluster import ray_connection
from tests.http_fake import JsonHttpFake, Request


class EmptyDashboard(JsonHttpFake):
    """A reachable member with no jobs (the earlier try never got there)."""

    def answer(self, request: Request):
        if request.path == "/api/jobs/":
            return 200, []
        if request.path == "/api/version":
            return 200, {"ray_version": "2.60.0", "version": "4"}
        return 404, {"detail": request.path}


def _refusing_url() -> str:
    with socket.socket() as s:  # a port nothing listens on once closed: connection refused
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def step(x=1):
    return x


def test_a_retry_goes_on_with_the_members_it_reaches(tmp_path, monkeypatch):
    from rayslice.hooks.ray import RayHook
    from rayslice.operators import step as step_module
    from rayslice.operators.tpu_slice import TpuSliceOperator

    with EmptyDashboard() as b:
        monkeypatch.setenv("AIRFLOW_CONN_REVIEW_A", json.dumps(ray_connection(_refusing_url())))
        monkeypatch.setenv("AIRFLOW_CONN_REVIEW_B", json.dumps(ray_connection(b.url)))
        monkeypatch.setenv("AIRFLOW_CONN_REVIEW_SET", json.dumps({"conn_type": "ray", "extra": {
            "clusters": ["review_a", "review_b"], "checkpoint_root": f"file://{tmp_path}", "shared_root": True}}))
        ran: list[list[str]] = []

        async def fake_run_on_set(spec, members, emit=print, on_cluster=None):
            ran.append([m.name for m in members])
            return "ran"

        monkeypatch.setattr(step_module, "run_on_set", fake_run_on_set)
        op = TpuSliceOperator(task_id="t", tpu="v6e-4", python_callable=step, ray_conn_id="review_set")
        op._set = RayHook("review_set").cluster_set()
        op._settings = op._set_members()
        owner = Owner(dag_id="d", run_id="r", task_id="t", try_number=2, ti_id="ti-2")
        spec = StepSpec.for_function(step, request=TpuSliceRequest(tpu="v6e-4"), owner=owner,
                                     checkpoint_root=f"file://{tmp_path}")
        assert asyncio.run(op._run_on_set(spec)) == "ran"
        assert ran and "review_b" in ran[0]


class StoppableDashboard(EmptyDashboard):
    """A reachable member whose job of the step is stopped by `on_kill`."""

    def __init__(self) -> None:
        super().__init__()
        self.stopped: list[str] = []

    def answer(self, request: Request):
        if request.method == "POST" and request.path.endswith("/stop"):
            self.stopped.append(request.path.split("/")[-2])
            return 200, {"stopped": True}
        return super().answer(request)


def test_a_kill_that_cannot_reach_a_member_still_keeps_its_job_from_running_the_step(tmp_path, monkeypatch):
    from rayslice.hooks.ray import RayHook
    from rayslice.operators import step as step_module
    from rayslice.operators.tpu_slice import TpuSliceOperator

    from rayslice.client.submission import submission_id
    from rayslice.core.cluster_claim import Claims
    from rayslice.core.context import checkpoint_dir_for

    with StoppableDashboard() as b:
        monkeypatch.setenv("AIRFLOW_CONN_REVIEW_A", json.dumps(ray_connection(_refusing_url())))
        monkeypatch.setenv("AIRFLOW_CONN_REVIEW_B", json.dumps(ray_connection(b.url)))
        monkeypatch.setenv("AIRFLOW_CONN_REVIEW_SET", json.dumps({"conn_type": "ray", "extra": {
            "clusters": ["review_a", "review_b"], "checkpoint_root": f"file://{tmp_path}", "shared_root": True}}))
        op = TpuSliceOperator(task_id="t", tpu="v6e-4", python_callable=step, ray_conn_id="review_set")
        seen = {}

        async def killed_while_waiting(spec, members, emit=print, on_cluster=None):
            # Both jobs wait in their clusters' queues (nobody claimed the step); the task is marked failed.
            seen["spec"] = spec
            await asyncio.to_thread(op.on_kill)
            raise asyncio.CancelledError

        monkeypatch.setattr(step_module, "run_on_set", killed_while_waiting)
        op._set = RayHook("review_set").cluster_set()
        op._settings = op._set_members()
        owner = Owner(dag_id="d", run_id="r", task_id="t", try_number=1, ti_id="ti-1")
        owner = owner.model_copy(update={"submission_id": submission_id(owner)})  # as `execute` makes it
        spec = StepSpec.for_function(step, request=TpuSliceRequest(tpu="v6e-4"), owner=owner,
                                     checkpoint_root=f"file://{tmp_path}")
        op._submission_id = owner.submission_id  # as `execute` sets it before it follows the step
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(op._run_on_set(spec))
        sid = seen["spec"].owner.submission_id
        assert b.stopped == [sid], "the reachable member's job was stopped"
    # review_a's job, which on_kill could not reach, is admitted there later: it must not get to run the step.
    folder = checkpoint_dir_for(seen["spec"].checkpoint_root, seen["spec"].owner)
    late = Claims(folder, member="review_a", submission_id=sid).take()
    assert not late.held_by("review_a", sid), "the killed task's step runs on review_a"
