"""Cloud TPU setup/teardown operators in real DAG runs (`dag.test()`), against the TPU v2 API HTTP fake.

The Cloud TPU API cannot run here: tests/fake_cloud_tpu.py serves it over real HTTP to the real
google-cloud-tpu client and checks every body against the client's protobuf messages.
"""

from __future__ import annotations

import asyncio
import re
import textwrap
import time

import pytest

from rayslice.cloud import cloud_tpu
from tests.airflow_env import load_dag_file, task_states, write_dag_file, xcom_values
from tests.fake_cloud_tpu import FakeCloudTpu
from tests.operators.moved_trigger import kill_while_still_deferred

PARENT = "projects/my-project/locations/us-east5-b"
NAME = f"{PARENT}/queuedResources/rs-slices"

DAGS = textwrap.dedent(
    """
    from datetime import datetime

    from airflow.sdk import DAG, task

    from rayslice.operators.cloud_tpu import CreateTpuSliceOperator, DeleteTpuSliceOperator

    START = datetime(2026, 1, 1)
    WHERE = dict(project="my-project", zone="us-east5-b", queued_resource_id="rs-slices", tpu="v6e-16",
                 num_slices=2, api_endpoint="FAKE_URL", poll_interval=0.05)


    @task
    def train():
        raise RuntimeError("the step failed on purpose")


    with DAG("tpu_lifecycle", schedule=None, start_date=START):
        create = CreateTpuSliceOperator(task_id="create", head_address="10.0.0.2:6379", active_timeout=30, **WHERE)
        delete = DeleteTpuSliceOperator(task_id="delete", **WHERE)
        create.as_setup() >> train() >> delete.as_teardown(setups=create)

    with DAG("tpu_lifecycle_on_a_worker", schedule=None, start_date=START):
        create = CreateTpuSliceOperator(task_id="create", head_address="10.0.0.2:6379", active_timeout=30,
                                        deferrable=False, **WHERE)
        delete = DeleteTpuSliceOperator(task_id="delete", **WHERE)
        create.as_setup() >> train() >> delete.as_teardown(setups=create)

    with DAG("tpu_teardown_only", schedule=None, start_date=START):
        DeleteTpuSliceOperator(task_id="delete", **WHERE)

    # Issue 50: no queued_resource_id: each run's own (per deployment, DAG and run), the same in setup and teardown.
    PER_RUN = dict(project="my-project", zone="us-east5-b", tpu="v6e-16", api_endpoint="FAKE_URL", poll_interval=0.05)
    for dag_id in ("tpu_per_run_a", "tpu_per_run_b"):
        with DAG(dag_id, schedule=None, start_date=START):
            create = CreateTpuSliceOperator(task_id="create", head_address="10.0.0.2:6379", active_timeout=30,
                                            network="ml-vpc",
                                            service_account="ray-tpu@my-project.iam.gserviceaccount.com", **PER_RUN)
            create.as_setup() >> DeleteTpuSliceOperator(task_id="delete", **PER_RUN).as_teardown(setups=create)

    with DAG("tpu_twin", schedule=None, start_date=START):  # run by two deployments with one run id
        create = CreateTpuSliceOperator(task_id="create", head_address="10.0.0.2:6379", active_timeout=30, **WHERE)
        create.as_setup() >> DeleteTpuSliceOperator(task_id="delete", **WHERE).as_teardown(setups=create)
    """
)

BAD = textwrap.dedent(
    """
    from datetime import datetime
    from airflow.sdk import DAG
    from rayslice.operators.cloud_tpu import CreateTpuSliceOperator

    with DAG("tpu_bad", schedule=None, start_date=datetime(2026, 1, 1)):
        CreateTpuSliceOperator(task_id="create", **{kwargs})
    """
)
GOOD = {"project": "my-project", "zone": "us-east5-b", "queued_resource_id": "rs", "tpu": "v6e-16"}


@pytest.fixture(scope="module")
def server():
    with FakeCloudTpu() as fake:
        yield fake


@pytest.fixture
def fake(server):
    server.queued.clear()
    server.requests.clear()
    server.zones = {"us-east5-b": ("v6e-4", "v6e-16")}
    cloud_tpu._zone_cache.clear()
    return server


@pytest.fixture(scope="module")
def dags(airflow_db, server):
    dags, errors = load_dag_file(write_dag_file("tpu_scenarios", DAGS.replace("FAKE_URL", server.url)))
    assert not errors
    return dags


@pytest.mark.parametrize("dag_id", ["tpu_lifecycle", "tpu_lifecycle_on_a_worker"],
                         ids=["waits-in-the-triggerer", "waits-on-the-worker"])
def test_the_slices_are_deleted_when_the_step_between_fails(fake, dags, dag_id, capfd):
    dr = dags[dag_id].test()
    assert ("waiting for ACTIVE in the triggerer" in capfd.readouterr().out) is (dag_id == "tpu_lifecycle")
    assert task_states(dr) == {"create": "success", "train": "failed", "delete": "success"}
    assert xcom_values(dr, "create") == [{"name": NAME, "tpu": "v6e-16", "num_slices": "2"}]
    assert xcom_values(dr, "delete") == ["deleted"]
    assert NAME not in fake.queued
    [(_, _, _, body)] = [r for r in fake.requests if r[0] == "POST"]
    node = body["tpu"]["nodeSpec"][0]["node"]
    from airflow.models import Variable

    deployment = Variable.get("rayslice_deployment")  # issue 38 (9): another Airflow's same run is another owner
    assert node["labels"]["rayslice-owner"] == cloud_tpu.owner_label(f"{deployment}/{dag_id}/{dr.run_id}")
    assert "/bin/ray\" start --address=10.0.0.2:6379" in node["metadata"]["startup-script"]


def test_a_type_the_zone_lacks_fails_before_anything_is_queued(fake, dags, capfd):
    fake.zones = {"us-east5-b": ("v6e-4",)}
    dr = dags["tpu_lifecycle"].test()
    assert task_states(dr)["create"] == "failed"
    assert "v6e-16 is not offered in zone us-east5-b" in capfd.readouterr().out
    assert not [r for r in fake.requests if r[0] == "POST"]


@pytest.mark.parametrize("dag_id", ["tpu_lifecycle", "tpu_lifecycle_on_a_worker"],
                         ids=["waits-in-the-triggerer", "waits-on-the-worker"])
def test_a_setup_that_never_gets_capacity_deletes_its_request(fake, dags, capfd, dag_id):
    fake.fail_with = "no capacity"
    try:
        dr = dags[dag_id].test()
    finally:
        fake.fail_with = None
    assert task_states(dr)["create"] == "failed"
    assert "is FAILED: no capacity" in capfd.readouterr().out
    assert NAME not in fake.queued
    assert len([r for r in fake.requests if r[0] == "DELETE"]) == 1


def test_a_pre_existing_queued_resource_is_never_deleted(fake, dags):
    spec = {"parent": PARENT, "nodeId": "rs-slices",
            "node": {"acceleratorType": "v6e-16", "runtimeVersion": "v2-alpha-tpuv6e"}}
    theirs = fake.add_queued(PARENT, "rs-slices", {"tpu": {"nodeSpec": [spec]}})
    dr = dags["tpu_lifecycle"].test()
    assert task_states(dr)["create"] == "failed"
    dr = dags["tpu_teardown_only"].test()
    assert task_states(dr) == {"delete": "success"}
    assert xcom_values(dr, "delete") == ["not-owned"]
    assert fake.queued[NAME] is theirs
    assert not [r for r in fake.requests if r[0] == "DELETE"]


def test_two_deployments_with_the_same_dag_and_run_keep_to_their_own_queued_resource(fake, dags, capfd):
    """Issue 38, ownership: two Airflows (prod and staging) run the same DAG with the same run id against one
    Cloud TPU API (the fake). The second neither adopts the first's queued resource on the name clash (its
    setup fails, naming it) nor deletes it in its teardown; the first's teardown still deletes its own.

    One metadata DB, not two Airflow homes: the deployment identity (the Airflow Variable
    `rayslice_deployment`, which lives in each Airflow's own DB) is switched between the runs. Each run is a
    `dag.test()` of one logical date, so one run id; `mark_success_pattern` runs only the setup or only the
    teardown, so the first Airflow's slices exist while the second one's run comes and goes.
    """
    from datetime import UTC, datetime

    from airflow.models import Variable

    when = datetime(2026, 3, 1, tzinfo=UTC)
    before = Variable.get("rayslice_deployment", default_var=None)

    def run(deployment: str, only: str | None = None):
        Variable.set("rayslice_deployment", deployment)
        skip = None if only is None else {"create": "delete", "delete": "create"}[only]
        return dags["tpu_twin"].test(logical_date=when, run_after=when, mark_success_pattern=skip)

    try:
        prod = run("airflow-prod", only="create")
        assert task_states(prod) == {"create": "success", "delete": "success"}  # delete: marked, not run
        theirs = fake.queued[NAME]
        owner = cloud_tpu.owner_label(f"airflow-prod/tpu_twin/{prod.run_id}")
        assert theirs["tpu"]["nodeSpec"][0]["node"]["labels"]["rayslice-owner"] == owner
        capfd.readouterr()

        staging = run("airflow-staging")  # (1) the same name exists: its setup fails, and takes nothing over
        assert staging.run_id == prod.run_id
        assert task_states(staging)["create"] == "failed"
        out = capfd.readouterr().out
        assert f"queued resource {NAME} already exists and was not made by airflow-staging/tpu_twin/" in out
        assert fake.queued[NAME] is theirs
        staging = run("airflow-staging", only="delete")  # (2) its teardown leaves prod's alone
        assert task_states(staging) == {"create": "success", "delete": "success"}
        assert xcom_values(staging, "delete") == ["not-owned"]
        assert fake.queued[NAME] is theirs
        assert not [r for r in fake.requests if r[0] == "DELETE"]

        prod = run("airflow-prod", only="delete")  # (3) prod's own teardown deletes it
        assert xcom_values(prod, "delete") == ["deleted"]
        assert NAME not in fake.queued
        assert len([r for r in fake.requests if r[0] == "DELETE"]) == 1
    finally:
        if before is None:
            Variable.delete("rayslice_deployment")
        else:
            Variable.set("rayslice_deployment", before)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({**GOOD, "tpu": "v6e-15"}, "not a v6e slice"),
        ({**GOOD, "zone": "useast"}, "zone 'useast' is invalid"),
        ({**GOOD, "queued_resource_id": "RS"}, "queued_resource_id 'RS' is invalid"),
        ({**GOOD, "head_address": "10.0.0.2"}, "host:port"),
        ({**GOOD, "active_timeout": 0}, "active_timeout=0"),
        ({**GOOD, "tpu": "v7x-16"}, "cannot be created through the Cloud TPU API"),
        ({**GOOD, "tpu": "v7x-16", "queued_resource_id": "run-{{ ts_nodash | lower }}"},
         "cannot be created through the Cloud TPU API"),  # the id, templated, is checked at run time; the type is not
    ],
)
def test_bad_arguments_fail_the_dag_import(tmp_path, airflow_db, kwargs, message):
    path = tmp_path / "tpu_bad.py"
    path.write_text(BAD.format(kwargs=repr(kwargs)))
    dags, errors = load_dag_file(path)
    assert not dags
    [error] = errors.values()
    assert "InvalidRequestError" in error and message in error


def test_the_connection_can_check_slice_types_against_its_zone(fake, monkeypatch):
    """Optional: a `ray` connection with a `cloud_tpu` extra checks a slice type at submit time (cached)."""
    import json

    from rayslice.hooks.ray import RayHook

    from rayslice.core.accelerators import TpuSliceRequest
    from rayslice.core.exceptions import InvalidRequestError

    extra = {"cloud_tpu": {"project": "my-project", "zone": "us-east5-b", "api_endpoint": fake.url}}
    monkeypatch.setenv("AIRFLOW_CONN_TPU_ZONE", json.dumps({"conn_type": "ray", "host": "http://h:8265",
                                                            "extra": extra}))
    hook = RayHook("tpu_zone")
    hook.check_tpu_type(TpuSliceRequest(tpu="v6e-16"))
    with pytest.raises(InvalidRequestError, match="v6e-32 is not offered in zone us-east5-b"):
        hook.check_tpu_type(TpuSliceRequest(tpu="v6e-32"))
    assert len([r for r in fake.requests if r[1].endswith("/acceleratorTypes")]) == 1  # cached
    monkeypatch.setenv("AIRFLOW_CONN_NO_ZONE", json.dumps({"conn_type": "ray", "host": "http://h:8265"}))
    RayHook("no_zone").check_tpu_type(TpuSliceRequest(tpu="v6e-32"))  # no extra: no check
    bad = {"cloud_tpu": {"zone": "us-east5-b"}}
    monkeypatch.setenv("AIRFLOW_CONN_BAD_ZONE", json.dumps({"conn_type": "ray", "host": "http://h", "extra": bad}))
    with pytest.raises(InvalidRequestError, match="must be"):
        RayHook("bad_zone").check_tpu_type(TpuSliceRequest(tpu="v6e-16"))


ZONE_CHECKED = textwrap.dedent(
    """
    from datetime import datetime
    from airflow.sdk import DAG
    from rayslice.operators.tpu_slice import TpuSliceOperator


    def train():
        return 1


    with DAG("tpu_zone_checked", schedule=None, start_date=datetime(2026, 1, 1)):
        TpuSliceOperator(task_id="train", tpu="v6e-32", python_callable=train, ray_conn_id="tpu_zone", retries=0)
    """
)


def test_a_slice_operator_fails_on_a_type_its_zone_lacks_before_asking_ray(fake, airflow_db, monkeypatch, capfd):
    """The connection's zone has no v6e-32: the task fails naming what the zone has; Ray is never asked."""
    import json

    # One server plays both the Cloud TPU API and the Ray dashboard: every request lands in fake.requests.
    extra = {"cloud_tpu": {"project": "my-project", "zone": "us-east5-b", "api_endpoint": fake.url}}
    monkeypatch.setenv("AIRFLOW_CONN_TPU_ZONE", json.dumps({"conn_type": "ray", "host": fake.url, "extra": extra}))
    dags, errors = load_dag_file(write_dag_file("tpu_zone_checked", ZONE_CHECKED))
    assert not errors
    dr = dags["tpu_zone_checked"].test()
    assert task_states(dr) == {"train": "failed"}
    out = capfd.readouterr().out
    assert "v6e-32 is not offered in zone us-east5-b: v6e there comes as v6e-16, v6e-4" in out, out[-3000:]
    assert [r[1] for r in fake.requests] == [f"/v2/{PARENT}/acceleratorTypes"]


# --- the deferred setup's trigger


def _trigger(server, **kwargs):
    from rayslice.operators.setup_triggers import QueuedSliceActiveTrigger

    queued = {"project": "my-project", "zone": "us-east5-b", "queued_resource_id": "rs-slices", "tpu": "v6e-16"}
    return QueuedSliceActiveTrigger(queued=queued, api_endpoint=server.url, owner="tpu_lifecycle/manual__1",
                                    deadline=kwargs.pop("deadline", 4e9), timeout=60, poll_interval=0.05, **kwargs)


def _queue(server) -> None:
    queued = cloud_tpu.QueuedSlice(project="my-project", zone="us-east5-b", queued_resource_id="rs-slices",
                                   tpu="v6e-16")
    cloud_tpu.QueuedSliceClient(queued, api_endpoint=server.url).create(owner="tpu_lifecycle/manual__1",
                                                                        script="#!/bin/sh\n")


async def _events(trigger) -> list[dict]:
    events = [event.payload async for event in trigger.run()]
    await trigger.cleanup()
    return events


def test_the_trigger_reports_active_slices_and_its_deadline(fake):
    _queue(fake)
    trigger = _trigger(fake)
    assert trigger.serialize()[0] == "rayslice.operators.setup_triggers.QueuedSliceActiveTrigger"
    assert asyncio.run(_events(trigger)) == [{"status": "ready", "name": NAME, "tpu": "v6e-16", "num_slices": "1"}]
    fake.queued.clear()
    fake.active_after_gets = None
    try:
        _queue(fake)
        [event] = asyncio.run(_events(_trigger(fake, deadline=time.time() + 0.3)))
    finally:
        fake.active_after_gets = 2
    assert event["status"] == "timeout" and "not ACTIVE after 60 s" in event["message"], event
    assert NAME in fake.queued  # the operator deletes it when it resumes, not the trigger


def test_a_killed_deferred_setup_deletes_its_request_and_a_moved_one_does_not(fake, monkeypatch):
    fake.active_after_gets = None
    try:
        _queue(fake)
        kill_while_still_deferred(_trigger(fake), monkeypatch)
        assert NAME in fake.queued
        asyncio.run(_trigger(fake).on_kill())  # no Airflow to ask (as when the user's kill reaches it): delete
    finally:
        fake.active_after_gets = 2
    assert NAME not in fake.queued


def test_passing_cloud_tpu_failures_are_told_from_lasting_ones():
    """Issue 36, item 9: the queued-resource trigger looks again after these instead of deleting its request
    (which would lose its place in Cloud TPU's queue)."""
    from google.api_core import exceptions as gexc

    from rayslice.cloud.cloud_tpu import _api_error

    for passing in (gexc.ServiceUnavailable("upgrade"), gexc.InternalServerError("oops"),
                    gexc.TooManyRequests("slow down"), gexc.DeadlineExceeded("late")):
        assert _api_error("get qr", passing).transient is True, passing
    for lasting in (gexc.PermissionDenied("no"), gexc.BadRequest("bad")):
        assert _api_error("get qr", lasting).transient is False, lasting


def test_without_an_id_each_run_of_each_dag_gets_its_own_queued_resource(fake, dags):
    """Issue 50: `run-{{ ts_nodash }}` collided across DAGs (and is undefined for asset-triggered runs): the default
    id is the run's own, from deployment, DAG and run id, and the teardown finds the same one."""
    from datetime import UTC, datetime

    from airflow.models import Variable

    from rayslice.cloud.cluster_names import per_run_name

    when = datetime(2026, 4, 1, tzinfo=UTC)
    runs = {dag_id: dags[dag_id].test(logical_date=when, run_after=when, mark_success_pattern="delete")
            for dag_id in ("tpu_per_run_a", "tpu_per_run_b")}
    deployment = Variable.get("rayslice_deployment")
    names = {dag_id: f"{PARENT}/queuedResources/{per_run_name(dag_id, dr.run_id, deployment)}"
             for dag_id, dr in runs.items()}
    assert runs["tpu_per_run_a"].run_id == runs["tpu_per_run_b"].run_id  # one logical time, two DAGs
    assert len(set(names.values())) == 2 and set(names.values()) <= set(fake.queued)
    for dag_id, dr in runs.items():
        assert task_states(dr) == {"create": "success", "delete": "success"}
        node = fake.queued[names[dag_id]]["tpu"]["nodeSpec"][0]["node"]
        assert node["networkConfig"] == {"network": "ml-vpc", "enableExternalIps": True}
        assert node["serviceAccount"]["email"] == "ray-tpu@my-project.iam.gserviceaccount.com"
        assert node["labels"]["rayslice-deployment"] == cloud_tpu.owner_label(deployment)
    dr = dags["tpu_per_run_a"].test(logical_date=when, run_after=when, mark_success_pattern="create")
    assert xcom_values(dr, "delete") == ["deleted"]
    assert names["tpu_per_run_a"] not in fake.queued and names["tpu_per_run_b"] in fake.queued


def test_the_per_run_id_needs_no_logical_date():
    """Asset-triggered runs have no logical date (no `ts`): the run's own id needs only the DAG and run ids."""
    from types import SimpleNamespace
    from unittest import mock

    from rayslice.operators.cloud_tpu import DeleteTpuSliceOperator

    op = DeleteTpuSliceOperator(task_id="delete", project="my-project", zone="us-east5-b", tpu="v6e-16")
    run = SimpleNamespace(dag_id="Train.Model", run_id="asset_triggered__2026-04-01T00:00:00.123+00:00",
                          logical_date=None)
    with mock.patch("rayslice.operators.cloud_tpu.RayHook.deployment", return_value="prod"):
        queued = op._queued({"dag_run": run})
    assert re.fullmatch(r"rs-train-model-[0-9a-f]{10}", queued.queued_resource_id)
