"""A set's step retried while an earlier try may still hold it on a member: defects found by trying to break the
review's fixes (issue 53), cluster-free: a fake dashboard over real HTTP for the member the retry reaches."""

from __future__ import annotations

import asyncio
import json

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.cluster_claim import Claims
from rayslice.core.context import checkpoint_dir_for
from rayslice.core.step import Owner, StepSpec
from rayslice.local.local_cluster import ray_connection
from tests.operators.test_cluster_set_retry_and_kill import EmptyDashboard, _refusing_url


def step(x=1):
    return x


def _retry(tmp_path, monkeypatch, a_conn: dict, a_resolves: bool = True):
    """Try 2 of a step on set (review_a, review_b) whose try 1 holds it on review_a; what try 2 did, or its error."""
    from airflow.exceptions import AirflowException
    from rayslice.hooks.ray import RayHook
    from rayslice.operators import step as step_module
    from rayslice.operators.tpu_slice import TpuSliceOperator

    from rayslice.core.exceptions import RaysliceError

    owner = Owner(dag_id="d", run_id="r", task_id="t", try_number=2, ti_id="ti-2")
    spec = StepSpec.for_function(step, request=TpuSliceRequest(tpu="v6e-4"), owner=owner,
                                 checkpoint_root=f"file://{tmp_path}")
    folder = checkpoint_dir_for(spec.checkpoint_root, owner)
    assert Claims(folder, member="review_a", submission_id="try1-job").take().held_by("review_a", "try1-job")
    ran: list[list[str]] = []

    async def fake_run_on_set(spec, members, emit=print, on_cluster=None):
        ran.append([m.name for m in members])
        return "ran"

    monkeypatch.setattr(step_module, "run_on_set", fake_run_on_set)
    with EmptyDashboard() as b:
        monkeypatch.setenv("AIRFLOW_CONN_REVIEW_A", json.dumps(a_conn))
        if not a_resolves:  # e.g. a `kuberay` extra whose Kubernetes API cannot be reached from this worker now
            real_settings = RayHook.settings

            def settings(hook):
                if hook.ray_conn_id == "review_a":
                    raise RaysliceError("could not resolve RayCluster 'tpus-a': the Kubernetes API timed out")
                return real_settings(hook)

            monkeypatch.setattr(RayHook, "settings", settings)
        monkeypatch.setenv("AIRFLOW_CONN_REVIEW_B", json.dumps(ray_connection(b.url)))
        monkeypatch.setenv("AIRFLOW_CONN_REVIEW_SET", json.dumps({"conn_type": "ray", "extra": {
            "clusters": ["review_a", "review_b"], "checkpoint_root": f"file://{tmp_path}", "shared_root": True}}))
        op = TpuSliceOperator(task_id="t", tpu="v6e-4", python_callable=step, ray_conn_id="review_set")
        op._set = RayHook("review_set").cluster_set()
        op._settings = op._set_members()
        try:
            asyncio.run(op._run_on_set(spec))
        except AirflowException as exc:
            return ran, exc
    return ran, None


def test_the_retry_refuses_beside_an_earlier_try_holding_the_step_on_a_member_it_cannot_reach(tmp_path, monkeypatch):
    """What the review's fix does (held up): the member's dashboard refuses connections."""
    ran, error = _retry(tmp_path, monkeypatch, ray_connection(_refusing_url()))
    assert ran == [] and error is not None and "holds the step on cluster review_a" in str(error)


def test_the_retry_refuses_beside_an_earlier_try_holding_the_step_on_a_member_whose_connection_fails(
        tmp_path, monkeypatch):
    ran, error = _retry(tmp_path, monkeypatch, ray_connection(_refusing_url()), a_resolves=False)
    assert ran == [], f"try 2 started on {ran} while try 1 may still run the step on review_a"
    assert error is not None


def test_the_retry_does_not_start_blind_beside_a_member_it_cannot_reach(tmp_path, monkeypatch):
    from rayslice.operators import step as step_module

    def storage_down(*args, **kwargs):
        raise OSError("503 Service Unavailable")

    monkeypatch.setattr(step_module, "end_other_chains", storage_down)
    ran, error = _retry(tmp_path, monkeypatch, ray_connection(_refusing_url()))
    assert ran == [], f"try 2 started on {ran} without knowing whether try 1 holds the step on review_a"
    assert error is not None
