"""A step started in the triggerer waits on Airflow as few times as a worker-equivalent step needs (issue 52).

Each round trip to Airflow from a trigger (an XCom read or push) goes through the triggerer's supervisor,
one request at a time in its loop; on a chain of short steps they add up. What is cut here, and what
must still hold: a trigger that submitted its job itself reads no log checkpoint (none can exist),
a restarted trigger of the same try, or one that reattached to its job, still resumes at its record;
the submission id and the link are pushed together, both before the job is submitted.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from airflow.sdk import BaseXCom
from airflow.sdk.execution_time import comms as messages
from airflow.sdk.execution_time import task_runner
from rayslice.operators.links import SUBMISSION_ID_KEY, RayJobLink
from rayslice.operators.triggers import LOG_CHECKPOINT_KEY

from tests.operators.test_trigger_parity import Comms, _dag, _end, _trigger


@pytest.fixture(scope="module")
def dags():
    from airflow.serialization.serialized_objects import DagSerialization

    dag = _dag()
    return dag, DagSerialization.from_dict(DagSerialization.to_dict(dag))


@pytest.fixture
def comms(monkeypatch):
    import json

    channel = Comms()
    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", channel, raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_RAY_DEFAULT", json.dumps(
        {"conn_type": "ray", "host": "http://10.1.2.3:8265", "extra": {"deployment": "parity"}}))
    return channel


def _checkpoint_reads(comms: Comms) -> int:
    return sum(isinstance(m, messages.GetXCom) and m.key == LOG_CHECKPOINT_KEY for m in comms.sent)


def _record_checkpoint(comms: Comms, sid: str, offset: int) -> None:
    comms.xcoms[("parity", "r", "lonely", -1, LOG_CHECKPOINT_KEY)] = BaseXCom.serialize_value(
        {"submission_id": sid, "offset": offset, "recent": [], "markers": {}})


def test_a_trigger_that_submitted_its_job_itself_starts_its_log_without_asking_for_a_checkpoint(dags, comms):
    trigger = _trigger(dags, "lonely")
    asyncio.run(trigger._build())
    comms.sent.clear()
    assert asyncio.run(trigger._checkpoint()) == {"offset": 0}
    assert _checkpoint_reads(comms) == 0


def test_a_restarted_trigger_of_the_same_try_still_resumes_at_its_checkpoint(dags, comms, monkeypatch):
    first = _trigger(dags, "lonely")
    asyncio.run(_end(first, 1, monkeypatch))  # this try's first trigger pushed its submission id
    _record_checkpoint(comms, first.submission_id, 120)
    again = _trigger(dags, "lonely")
    again._task_instance.id = first.task_instance.id
    asyncio.run(again._build())
    assert again.submission_id == first.submission_id
    assert asyncio.run(again._checkpoint())["offset"] == 120
    assert _checkpoint_reads(comms) == 1


def test_a_trigger_that_reattached_to_its_job_reads_the_checkpoint(dags, comms):
    """Its id's push was lost, so `_build` found no earlier trigger; the job existed: an earlier one relayed."""
    trigger = _trigger(dags, "lonely")
    asyncio.run(trigger._build())
    _record_checkpoint(comms, trigger.submission_id, 64)
    trigger._reattached(object())  # what `submit_step` calls when the job was there already
    assert asyncio.run(trigger._checkpoint())["offset"] == 64


def test_the_submission_id_and_the_link_are_pushed_together_before_the_job_is_submitted(dags, comms, monkeypatch):
    """Both pushes are in flight at once (each waits here for the other), and both end before `submit_step`."""
    both = threading.Barrier(2, timeout=10)
    order: list[str] = []
    send = comms.send

    def together(msg):
        if isinstance(msg, messages.SetXCom) and msg.key in (SUBMISSION_ID_KEY, RayJobLink().xcom_key):
            both.wait()  # raises BrokenBarrierError if the other push never comes while this one waits
            order.append(msg.key)
        return send(msg)

    monkeypatch.setattr(comms, "send", together)
    trigger = _trigger(dags, "lonely")
    from rayslice.operators import start_trigger

    async def submitted(*args, **kwargs):
        order.append("submitted")
        return trigger.submission_id

    operator, spec = asyncio.run(trigger._build())

    async def follow():
        yield trigger._event("success", 0, log_complete=True, result=1)

    from tests.operators.test_trigger_parity import _Client

    monkeypatch.setattr(start_trigger, "submit_step", submitted)
    monkeypatch.setattr(type(operator._settings), "async_client", lambda self: _Client())
    trigger._follow = follow

    async def run():
        return [event async for event in trigger._submit_and_follow(operator, spec)]

    asyncio.run(run())
    assert sorted(order[:2]) == sorted([SUBMISSION_ID_KEY, RayJobLink().xcom_key]) and order[2] == "submitted"


def test_a_retrys_moved_trigger_whose_id_push_was_lost_keeps_the_try_s_log_checkpoint(dags, comms):
    """Try 2's first trigger cleared try 1's XComs, its id's push failed, it relayed and recorded; it moved.

    The next trigger finds no id pushed, as a try's first trigger would: it must not take the try's own
    log checkpoint for an earlier try's (deleting it re-relays the whole log: every line twice).
    """
    first = _trigger(dags, "lonely", try_number=2)
    asyncio.run(first._build())  # nothing of try 1 left; its own id's push (in `_submit_and_follow`) is lost
    _record_checkpoint(comms, first.submission_id, 120)
    again = _trigger(dags, "lonely", try_number=2)
    again._task_instance.id = first.task_instance.id
    asyncio.run(again._build())
    again._reattached(object())  # the job was there: the first trigger submitted it
    assert asyncio.run(again._checkpoint())["offset"] == 120
