"""Steps that start in the triggerer: what the DAG carries there, and each map index's own arguments.

The end-to-end proof (no task process, XComs, logs, links, retries) is tests/e2e/test_trigger_start.py;
here: the serialized DAG (what the triggerer reads) holds what a trigger needs, every map index of a
mapped step is rebuilt with its own arguments (the Task SDK's own expansion is the reference), and a
trigger that cannot build its step sends it to a worker instead of leaving it deferred.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from types import SimpleNamespace

import pytest
from airflow.sdk import DAG, task
from airflow.serialization.serialized_objects import DagSerialization
from rayslice.operators.accelerator import AcceleratorOperator
from rayslice.operators.start_trigger import START_ON_WORKER, XCOM_REF, RayStepStartTrigger

START = datetime(2026, 1, 1)


def score(shard: int, scale: int = 1) -> dict:
    return {"shard": shard, "scale": scale}


def _serialized(dag: DAG):
    return DagSerialization.from_dict(DagSerialization.to_dict(dag))


def _trigger_for(task_, map_index: int = -1, step=None) -> RayStepStartTrigger:
    trigger = RayStepStartTrigger(step=step)
    trigger._task_instance = SimpleNamespace(task=task_, task_id=task_.task_id, map_index=map_index,
                                             dag_id="d", run_id="r")
    return trigger


def test_a_deferrable_step_starts_in_the_triggerer_with_its_function_pickled_at_parse_time():
    with DAG("start_unmapped", schedule=None, start_date=START) as dag:
        @task
        def upstream() -> int:
            return 3

        @task.ray_accelerator(accelerator="GPU", count=0.25)
        def step(shard: int, scale: int = 1) -> dict:
            return score(shard, scale)

        step(upstream(), scale="{{ ti.try_number }}")
        AcceleratorOperator(task_id="blocking", accelerator="GPU", count=0.25, callable="m:f", deferrable=False)
    serialized = _serialized(dag)
    op = serialized.get_task("step")
    assert op.start_from_trigger is True
    trigger = _trigger_for(op, step=dag.get_task("step").start_trigger_args.trigger_kwargs["step"])
    operator = asyncio.run(_operator_without_xcom(trigger))
    assert operator.shipped_callable["parameters"] == [["shard", 1, False], ["scale", 1, True]]
    assert operator.op_args == [3] and operator.op_kwargs == {"scale": "{{ ti.try_number }}"}  # rendered later
    assert serialized.get_task("blocking").start_from_trigger is False


async def _operator_without_xcom(trigger: RayStepStartTrigger):
    async def resolve(value):  # the upstream's XCom, as BaseXCom.aget_one would read it
        if isinstance(value, dict) and set(value) == {XCOM_REF}:
            return 3
        if isinstance(value, list):
            return [await resolve(v) for v in value]
        return value

    trigger._resolve = resolve
    return await trigger._operator()


def test_every_map_index_gets_its_own_arguments_as_the_task_sdk_expands_them():
    with DAG("start_mapped", schedule=None, start_date=START) as dag:
        @task.ray_accelerator(accelerator="GPU", count=0.25)
        def step(shard: int, scale: int, tag: str = "") -> dict:
            return score(shard, scale)

        step.partial(tag="t").expand(shard=[10, 11, 12], scale=[1, 2])
        AcceleratorOperator.partial(task_id="classic", accelerator="GPU", callable="m:f").expand(
            count=[0.25, 0.5], op_kwargs=[{"a": 1}, {"a": 2}, {"a": 3}])
    serialized = _serialized(dag)
    for task_id, length in (("step", 6), ("classic", 6)):
        sdk_task, op = dag.get_task(task_id), serialized.get_task(task_id)
        assert op.start_from_trigger is True and op.start_trigger_args is not None
        for index in range(length):
            expected, _ = sdk_task._expand_mapped_kwargs({"ti": SimpleNamespace(map_index=index)})
            built = asyncio.run(_trigger_for(op, index)._operator())
            if task_id == "step":
                assert built.op_kwargs == {"tag": "t", **expected["op_kwargs"]}
                assert built.shipped_callable["pickled"]
            else:
                assert (built.count, built.op_kwargs) == (expected["count"], expected["op_kwargs"])


def test_a_mapped_step_the_triggerer_cannot_build_goes_to_a_worker_instead_of_hanging(monkeypatch):
    from airflow.sdk.execution_time import task_runner

    from tests.operators.test_trigger_parity import Comms

    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", Comms(), raising=False)
    with DAG("start_fallback", schedule=None, start_date=START) as dag:
        AcceleratorOperator.partial(task_id="fn", accelerator="GPU", count=0.25, python_callable=score).expand(
            op_kwargs=[{"shard": 1}, {"shard": 2}])
    op = _serialized(dag).get_task("fn")
    assert op.start_from_trigger is True
    trigger = RayStepStartTrigger(**{"unexpected": 1})  # a trigger always inflates
    trigger._task_instance = SimpleNamespace(task=op, task_id="fn", map_index=0, dag_id="d", run_id="r", try_number=1,
                                             id="ti-1")
    trigger._context = {"ti": trigger._task_instance}

    async def first_event():
        async for event in trigger.run():
            return event.payload

    event = asyncio.run(first_event())
    assert event["status"] == START_ON_WORKER
    assert "pickled on a worker" in event["reason"]


def test_a_function_using_a_name_defined_later_is_pickled_on_a_worker_and_says_why():
    namespace: dict = {}
    exec("def late():\n    return helper_defined_below()\n", namespace)  # noqa: S102
    with DAG("start_late", schedule=None, start_date=START):
        op = AcceleratorOperator(task_id="late", accelerator="GPU", count=0.25, python_callable=namespace["late"])
    assert op.start_from_trigger is False
    assert "helper_defined_below" in op.start_blocker


@pytest.mark.parametrize("deferrable", [True, False])
def test_deferrable_is_the_default_and_blocking_stays_available(deferrable):
    kwargs = {} if deferrable else {"deferrable": False}
    with DAG(f"start_default_{deferrable}", schedule=None, start_date=START) as dag:
        @task.ray_accelerator(accelerator="GPU", count=0.25, **kwargs)
        def step(shard: int) -> dict:
            return score(shard)

        step.expand(shard=[1, 2])
    op = _serialized(dag).get_task("step")
    assert op.start_from_trigger is deferrable
    assert dag.get_task("step").partial_kwargs.get("deferrable", True) is deferrable


def test_the_queue_rank_and_team_reach_the_trigger():
    """`priority=` and `team=` order the step in the admission queue: the triggerer's rebuild keeps them."""
    with DAG("start_ranked", schedule=None, start_date=START) as dag:
        AcceleratorOperator(task_id="ranked", accelerator="GPU", count=0.25, callable="m:f", priority=7,
                            team="vision")
        AcceleratorOperator.partial(task_id="swept", accelerator="GPU", count=0.25, callable="m:f", priority=3,
                                    team="nlp").expand(op_kwargs=[{"shard": 0}, {"shard": 1}])
    serialized = _serialized(dag)
    unmapped = _trigger_for(serialized.get_task("ranked"),
                            step=dag.get_task("ranked").start_trigger_args.trigger_kwargs["step"])
    mapped = _trigger_for(serialized.get_task("swept"), map_index=1)
    for trigger, rank, team in ((unmapped, 7, "vision"), (mapped, 3, "nlp")):
        operator = asyncio.run(_operator_without_xcom(trigger))
        assert (operator.priority, operator.team) == (rank, team)
