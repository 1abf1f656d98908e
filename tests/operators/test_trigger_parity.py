"""A step started in the triggerer ends as one started on a worker (issue 36): what it reads and pushes.

The trigger runs against real serialized DAGs (what the triggerer hands it) and the Task SDK's own
XCom classes; only the channel to Airflow's execution API is a stand-in (`Comms`), which keeps the
messages the SDK sends: `SetXCom` (with its `mapped_length`, from which the execution API writes
the TaskMap row), `GetXCom`, `DeleteXCom`. The reference for each expectation is the worker's code
path in the Task SDK (named in each test). The same DAG patterns run both ways through a real
scheduler and triggerer in tests/e2e/test_trigger_parity.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from datetime import datetime
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk import DAG, task
from airflow.sdk.execution_time import comms as messages
from airflow.sdk.execution_time import task_runner
from airflow.serialization.serialized_objects import DagSerialization
from airflow.triggers.base import TaskSuccessEvent, TriggerEvent
from rayslice.operators import start_trigger
from rayslice.operators.links import SUBMISSION_ID_KEY, RayJobLink
from rayslice.operators.start_trigger import RayStepStartTrigger

from tests.operators import elsewhere_xcom

START = datetime(2026, 1, 1)
DASHBOARD = "http://10.1.2.3:8265"
UPSTREAM_TEXT = "{{ 6 * 7 }} and {{ ds }}"
UPSTREAM_BLOCK = "{% for i in range(2) %}x{% endfor %}"


class Comms:
    """The triggerer's channel to its supervisor: XComs kept in a dict, every message recorded."""

    def __init__(self) -> None:
        self.xcoms: dict[tuple, Any] = {}
        self.sent: list[Any] = []

    def send(self, msg: Any) -> Any:
        self.sent.append(msg)
        where = (msg.dag_id, msg.run_id, msg.task_id, msg.map_index if msg.map_index is not None else -1, msg.key) \
            if hasattr(msg, "key") else None
        if isinstance(msg, messages.SetXCom):
            self.xcoms[where] = msg.value
            return None
        if isinstance(msg, messages.GetXCom):
            return messages.XComResult(key=msg.key, value=self.xcoms.get(where))
        if isinstance(msg, messages.DeleteXCom):
            self.xcoms.pop(where, None)
            return None
        raise AssertionError(f"unexpected message {msg!r}")

    async def asend(self, msg: Any) -> Any:
        return self.send(msg)

    def sets(self, key: str) -> list[Any]:
        return [m for m in self.sent if isinstance(m, messages.SetXCom) and m.key == key]


@pytest.fixture
def comms(monkeypatch):
    channel = Comms()
    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", channel, raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_RAY_DEFAULT", json.dumps(
        {"conn_type": "ray", "host": DASHBOARD, "extra": {"deployment": "parity"}}))
    return channel


def _dag() -> DAG:
    with DAG("parity", schedule=None, start_date=START) as dag:
        @task.ray_accelerator(accelerator="GPU", count=0.25)
        def shards() -> list:
            return [1, 2, 3]

        @task
        def square(x: int) -> int:
            return x * x

        square.expand(x=shards())

        @task.ray_accelerator(accelerator="GPU", count=0.25)
        def kwargs_list() -> list:
            return [{"x": 1}, {"x": 2}]

        @task
        def add(x: int) -> int:
            return x + 1

        add.expand_kwargs(kwargs_list())

        @task.ray_accelerator(accelerator="GPU", count=0.25, multiple_outputs=True)
        def pair() -> dict:
            return {"a": 1, "b": [2]}

        @task.ray_accelerator(accelerator="GPU", count=0.25)
        def lonely() -> int:
            return 1

        @task
        def text() -> str:
            return UPSTREAM_TEXT

        @task
        def texts() -> list:
            return [UPSTREAM_TEXT, UPSTREAM_BLOCK]

        @task.ray_accelerator(accelerator="GPU", count=0.25)
        def echo(value: str, tag: str = "") -> str:
            return value

        echo(text(), tag="{{ 6 * 7 }}")
        echo.override(task_id="echo_mapped", on_success_callback=print, on_failure_callback=print).partial(
            tag="{{ 6 * 7 }}").expand(value=texts())
        pair()
        lonely()
    return dag


@pytest.fixture(scope="module")
def dags():
    dag = _dag()
    return dag, DagSerialization.from_dict(DagSerialization.to_dict(dag))


def _trigger(dags, task_id: str, map_index: int = -1, try_number: int = 1) -> RayStepStartTrigger:
    dag, serialized = dags
    op = serialized.get_task(task_id)
    args = dag.get_task(task_id).start_trigger_args
    trigger = RayStepStartTrigger(step=None if map_index >= 0 else args.trigger_kwargs["step"])
    ti = SimpleNamespace(task=op, task_id=task_id, map_index=map_index, dag_id="parity", run_id="r",
                         try_number=try_number, id=uuid.uuid4())
    trigger._task_instance = ti
    trigger._context = {"ti": ti, "params": {}, "run_id": "r", "dag_run": SimpleNamespace(conf={})}
    return trigger


class _Client:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def list_jobs(self):  # no earlier try's job runs
        return []


async def _end(trigger: RayStepStartTrigger, result: Any, monkeypatch) -> list[TriggerEvent]:
    """The trigger's end after a Ray job that returned `result` (the job itself is not what is tested)."""
    operator, spec = await trigger._build()
    trigger.built = spec

    async def submitted(*args, **kwargs):
        return trigger.submission_id

    async def follow():
        yield trigger._event("success", 0, log_complete=True, result=result)

    monkeypatch.setattr(start_trigger, "submit_step", submitted)
    monkeypatch.setattr(type(operator._settings), "async_client", lambda self: _Client())
    trigger._follow = follow
    return [event async for event in trigger._submit_and_follow(operator, spec)]


def _stored(comms: Comms, task_id: str, key: str, map_index: int = -1) -> Any:
    from airflow.sdk import BaseXCom

    value = comms.xcoms.get(("parity", "r", task_id, map_index, key))
    return None if value is None else BaseXCom.deserialize_value(SimpleNamespace(value=value))


@pytest.mark.parametrize(("task_id", "result", "length"), [("shards", [1, 2, 3], 3), ("shards", {"a": 1, "b": 2}, 2),
                                                          ("kwargs_list", [{"x": 1}, {"x": 2}], 2)])
def test_a_step_mapped_over_gets_its_length_recorded_as_a_worker_records_it(dags, comms, monkeypatch, task_id,
                                                                            result, length):
    """Task SDK `_push_xcom_if_needed`: an unmapped task with mapped dependants pushes `mapped_length`."""
    events = asyncio.run(_end(_trigger(dags, task_id), result, monkeypatch))
    assert isinstance(events[-1], TaskSuccessEvent)
    (pushed,) = comms.sets("return_value")
    assert pushed.mapped_length == length
    assert _stored(comms, task_id, "return_value") == result


def test_a_step_nothing_maps_over_records_no_length(dags, comms, monkeypatch):
    asyncio.run(_end(_trigger(dags, "lonely"), 1, monkeypatch))
    assert [m.mapped_length for m in comms.sets("return_value")] == [None]


def test_an_unmappable_result_resumes_on_a_worker_which_fails_as_airflow_does(dags, comms, monkeypatch):
    """A worker raises UnmappableXComTypePushed (or XComForMappingNotPushed): the trigger pushes nothing and
    hands the result to a worker (execute_complete returns it, the Task SDK pushes it and fails)."""
    for result in (5, None):
        comms.sent.clear()
        events = asyncio.run(_end(_trigger(dags, "shards"), result, monkeypatch))
        assert not isinstance(events[-1], TaskSuccessEvent)
        assert events[-1].payload["status"] == "success" and events[-1].payload["result"] == result
        assert comms.sets("return_value") == []


def test_multiple_outputs_push_every_key_then_the_whole_value(dags, comms, monkeypatch):
    events = asyncio.run(_end(_trigger(dags, "pair"), {"a": 1, "b": [2]}, monkeypatch))
    assert isinstance(events[-1], TaskSuccessEvent)
    assert (_stored(comms, "pair", "a"), _stored(comms, "pair", "b")) == (1, [2])
    assert _stored(comms, "pair", "return_value") == {"a": 1, "b": [2]}


def test_upstream_values_reach_the_step_literally_and_its_own_templates_are_rendered(dags, comms):
    """A worker renders templated fields with the XCom values resolved but never rendered
    (`Templater.render_template` returns `XComArg.resolve()` as it is; a mapped task's resolved
    expand values are its `seen_oids`)."""
    from airflow.sdk import BaseXCom

    comms.xcoms[("parity", "r", "text", -1, "return_value")] = BaseXCom.serialize_value(UPSTREAM_TEXT)
    comms.xcoms[("parity", "r", "texts", -1, "return_value")] = BaseXCom.serialize_value(
        [UPSTREAM_TEXT, UPSTREAM_BLOCK])
    _, spec = asyncio.run(_trigger(dags, "echo")._build())
    assert spec.kwargs == {"value": UPSTREAM_TEXT, "tag": "42"}
    for index, expected in enumerate((UPSTREAM_TEXT, UPSTREAM_BLOCK)):
        _, spec = asyncio.run(_trigger(dags, "echo_mapped", map_index=index)._build())
        assert spec.kwargs == {"value": expected, "tag": "42"}


def test_the_configured_xcom_backend_reads_and_writes(dags, comms, monkeypatch):
    """The Task SDK reads and pushes through `[core] xcom_backend` (`resolve_xcom_backend`)."""
    from airflow.sdk import BaseXCom

    monkeypatch.setenv("AIRFLOW__CORE__XCOM_BACKEND", "tests.operators.elsewhere_xcom.ElsewhereXCom")
    ref = f"{elsewhere_xcom.PREFIX}parity/r/text/-1/return_value"
    elsewhere_xcom.STORE[ref] = UPSTREAM_BLOCK
    comms.xcoms[("parity", "r", "text", -1, "return_value")] = BaseXCom.serialize_value(ref)
    trigger = _trigger(dags, "echo")
    events = asyncio.run(_end(trigger, {"out": 1}, monkeypatch))
    assert isinstance(events[-1], TaskSuccessEvent)
    assert trigger.built.kwargs["value"] == UPSTREAM_BLOCK  # the upstream's value, read through the backend
    stored = _stored(comms, "echo", "return_value")
    assert stored == f"{elsewhere_xcom.PREFIX}parity/r/echo/-1/return_value"  # only a reference in the DB
    assert elsewhere_xcom.STORE[stored] == {"out": 1}


def test_a_new_try_starts_without_the_last_tries_xcoms(dags, comms, monkeypatch):
    """A worker deletes its task instance's XComs when a try starts (`xcom_keys_to_clear`); a cleared step
    whose next try fails must not leave the succeeded try's result for `all_done` tasks."""
    first = _trigger(dags, "pair", try_number=1)
    asyncio.run(_end(first, {"a": 1, "b": [2]}, monkeypatch))
    assert _stored(comms, "pair", "return_value") == {"a": 1, "b": [2]}
    second = _trigger(dags, "pair", try_number=2)
    asyncio.run(second._build())
    for key in ("return_value", "a", "b", SUBMISSION_ID_KEY, RayJobLink().xcom_key):
        assert _stored(comms, "pair", key) is None, key
    # The same try's trigger again (moved, restarted) keeps what its try pushed.
    asyncio.run(_end(second, {"a": 3, "b": [4]}, monkeypatch))
    again = _trigger(dags, "pair", try_number=2)
    again._task_instance.id = second.task_instance.id
    asyncio.run(again._build())
    assert _stored(comms, "pair", "return_value") == {"a": 3, "b": [4]}


def test_a_new_try_clears_the_last_tries_xcoms_though_it_recorded_no_submission_id(dags, comms, monkeypatch):
    """A worker clears whatever its task instance holds (`xcom_keys_to_clear`), not only what a try that
    recorded its submission id pushed: the earlier try's submission id push failed (the trigger only warns)."""
    first = _trigger(dags, "pair", try_number=1)
    asyncio.run(_end(first, {"a": 1, "b": [2]}, monkeypatch))
    comms.xcoms.pop(("parity", "r", "pair", -1, SUBMISSION_ID_KEY))
    asyncio.run(_trigger(dags, "pair", try_number=2)._build())
    for key in ("return_value", "a", "b", RayJobLink().xcom_key, start_trigger.DEADLINE_KEY):
        assert _stored(comms, "pair", key) is None, key


def test_a_first_try_deletes_nothing(dags, comms, monkeypatch):
    asyncio.run(_trigger(dags, "pair", try_number=1)._build())
    assert [m for m in comms.sent if isinstance(m, messages.DeleteXCom)] == []


def test_the_link_and_the_log_name_the_plugin_route_not_the_dashboard(dags, comms, monkeypatch, caplog):
    trigger = _trigger(dags, "lonely")
    with caplog.at_level(logging.INFO):
        asyncio.run(_end(trigger, 1, monkeypatch))
    link = _stored(comms, "lonely", RayJobLink().xcom_key)
    assert link.endswith(f"/rayslice/job/{trigger.submission_id}?conn_id=ray_default"), link
    assert DASHBOARD not in caplog.text and "10.1.2.3" not in caplog.text


def test_a_step_in_a_mapped_task_group_is_submitted_from_a_worker():
    """Each group index reads its share of the group's input and its upstreams' XComs by the Task SDK's
    map-index rules; the trigger does not rebuild those, so the step is not started in the triggerer."""
    from airflow.sdk import task_group

    with DAG("parity_group", schedule=None, start_date=START) as dag:
        @task_group
        def group(x: int):
            @task.ray_accelerator(accelerator="GPU", count=0.25)
            def double(x: int) -> int:
                return 2 * x

            double(x)

        group.expand(x=[1, 2])
    step = dag.get_task("group.double")
    assert step.start_from_trigger is False and step.start_blocker == "the step is in a mapped task group"


def test_a_local_folder_the_triggerer_cannot_read_as_a_worker_would_starts_the_step_on_a_worker(comms, tmp_path):
    """A worker zips `working_dir` from its own disk (a relative path: from its own folder)."""
    from rayslice.operators.accelerator import AcceleratorOperator
    from rayslice.operators.start_trigger import CannotStart

    with DAG("parity_folders", schedule=None, start_date=START) as dag:
        for name, folder in (("relative", "code/here"), ("missing", str(tmp_path / "nowhere")),
                             ("present", str(tmp_path))):
            AcceleratorOperator(task_id=name, accelerator="GPU", count=0.25, callable="m:f",
                                runtime_env={"working_dir": folder})
    serialized = DagSerialization.from_dict(DagSerialization.to_dict(dag))
    for name, blocked in (("relative", True), ("missing", True), ("present", False)):
        trigger = _trigger((dag, serialized), name)
        trigger._task_instance.dag_id = "parity_folders"
        if blocked:
            with pytest.raises(CannotStart, match="working_dir"):
                asyncio.run(trigger._build())
        else:
            asyncio.run(trigger._build())


def test_folders_are_zipped_off_the_event_loop(tmp_path, monkeypatch):
    """A triggerer runs every trigger on one event loop: seconds of zipping there stall them all."""
    import threading

    from rayslice.client import uploads

    (tmp_path / "a.py").write_text("x = 1\n")
    threads = []
    zip_folder = uploads.package_of

    def package_of(*args, **kwargs):
        threads.append(threading.current_thread())
        return zip_folder(*args, **kwargs)

    class Client:
        address = "http://ray"

        async def ensure_package(self, data):
            return "gcs://_ray_pkg_x.zip"

    monkeypatch.setattr(uploads, "package_of", package_of)
    asyncio.run(uploads.upload_runtime_env(Client(), {"working_dir": str(tmp_path)}))
    assert threads and threads[0] is not threading.main_thread()


def test_a_moved_trigger_keeps_the_deadline_its_try_started_with(comms, monkeypatch):
    """A deadline derived from the step's limits counts from the try's start, not from each move."""
    from rayslice.operators.accelerator import AcceleratorOperator

    with DAG("parity_deadline", schedule=None, start_date=START) as dag:
        AcceleratorOperator(task_id="bounded", accelerator="GPU", count=0.25, callable="m:f", step_timeout=60)
    dags = (dag, DagSerialization.from_dict(DagSerialization.to_dict(dag)))
    first = _trigger(dags, "bounded")
    first._task_instance.dag_id = "parity_deadline"
    asyncio.run(_end(first, 1, monkeypatch))
    now = start_trigger.time.time()
    monkeypatch.setattr(start_trigger.time, "time", lambda: now + 500)  # the trigger moves 500 s later
    moved = _trigger(dags, "bounded")
    moved._task_instance.dag_id, moved._task_instance.id = "parity_deadline", first.task_instance.id
    asyncio.run(moved._build())
    assert moved.deadline == first.deadline


def test_the_cloud_tpu_zone_is_checked_in_the_triggerer_too(comms, monkeypatch):
    from rayslice.hooks.ray import RayHook
    from rayslice.operators.tpu_slice import TpuSliceOperator

    checked = []
    monkeypatch.setattr(RayHook, "check_tpu_type", lambda self, request: checked.append(request.pod_type))
    with DAG("parity_zone", schedule=None, start_date=START) as dag:
        TpuSliceOperator(task_id="sliced", tpu="v6e-16", callable="m:f")
    trigger = _trigger((dag, DagSerialization.from_dict(DagSerialization.to_dict(dag))), "sliced")
    trigger._task_instance.dag_id = "parity_zone"
    asyncio.run(trigger._build())
    assert checked == ["v6e-16"]


def test_a_trigger_resumed_past_the_result_line_still_has_the_result(comms):
    """Item 3: the log checkpoint keeps the marker lines already passed, so a trigger moved after the result
    line and before its event ends the step with its result (not "printed no rayslice result", nor a rerun)."""
    from rayslice.operators.triggers import RayStepTrigger

    from rayslice.client.jobs_client import JobDetails
    from rayslice.client.submission import LogFollower, outcome
    from rayslice.core.step import format_result

    before = RayStepTrigger(ray_conn_id="ray_default", submission_id="sid-1")
    before._task_instance = SimpleNamespace(dag_id="parity", run_id="r", task_id="t", map_index=-1)
    relayed: list[str] = []
    lines = LogFollower(relayed.append)
    lines.feed(f"(GPU pid=1) step line\n{format_result({'out': 7})}\n[rayslice] released\n")
    asyncio.run(before._record(lines))  # what a trigger records as the triggerer stops or moves it
    after = RayStepTrigger(ray_conn_id="ray_default", submission_id="sid-1")
    after._task_instance = before.task_instance
    resumed = LogFollower(relayed.append, **asyncio.run(after._checkpoint()))
    assert resumed.offset == lines.offset
    job = JobDetails(submission_id="sid-1", status="SUCCEEDED", entrypoint="x")
    assert outcome(job, resumed.markers) == {"out": 7}


@pytest.mark.parametrize("deferrable", [True, False])
def test_a_worker_renders_a_decorated_steps_fields_once(deferrable):
    """`op_kwargs` is a template field of both the decorator and the operator: rendered twice, the second
    pass rendered the values the first pass read from XCom (a worker gave the step "42 and ")."""

    class Upstream:  # an XComArg as the Templater sees it: `resolve()` gives the upstream's value
        def resolve(self, context):
            return UPSTREAM_TEXT

    with DAG(f"parity_once_{deferrable}", schedule=None, start_date=START) as dag:
        @task.ray_accelerator(accelerator="GPU", count=0.25, deferrable=deferrable)
        def echo(value: str, tag: str = "") -> str:
            return value

        echo(value="x", tag="{{ 6 * 7 }}")
    op = dag.get_task("echo")
    op.op_kwargs = {"value": Upstream(), "tag": "{{ 6 * 7 }}"}
    op.render_template_fields({"ds": "2026-01-01"})
    assert op.op_kwargs == {"value": UPSTREAM_TEXT, "tag": "42"}


def test_a_field_that_does_not_render_fails_on_a_worker_as_airflow_fails_it(dags, comms):
    """A worker fails the task with Jinja's own error as it renders: the trigger leaves the task to one."""
    from rayslice.operators.start_trigger import CannotStart

    trigger = _trigger(dags, "echo")
    trigger._context = {**trigger._context, "params": None}  # `{{ params.n }}`-style fields cannot render
    trigger.step = {**trigger.step, "op_kwargs": {"tag": "{{ params.n.missing }}"}}
    from airflow.sdk import BaseXCom

    comms.xcoms[("parity", "r", "text", -1, "return_value")] = BaseXCom.serialize_value(UPSTREAM_TEXT)
    with pytest.raises(CannotStart, match="do not render here"):
        asyncio.run(trigger._build())


def test_a_step_with_a_success_callback_ends_on_a_worker_which_runs_it(dags, comms, monkeypatch):
    """Airflow 3.3's DAG processor runs only failure callbacks for a task a trigger ended
    (`airflow/dag_processing/processor.py`, `_execute_task_callbacks`): a worker ends such a step."""
    from airflow.sdk import BaseXCom

    comms.xcoms[("parity", "r", "texts", -1, "return_value")] = BaseXCom.serialize_value(["v"])
    events = asyncio.run(_end(_trigger(dags, "echo_mapped", map_index=0), ["v", "42"], monkeypatch))
    assert not isinstance(events[-1], TaskSuccessEvent)
    assert events[-1].payload["status"] == "success" and events[-1].payload["result"] == ["v", "42"]
    assert comms.sets("return_value") == []  # the worker pushes it
