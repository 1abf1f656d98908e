"""RayStepTrigger: serialization, and run()/on_kill() against real Ray jobs."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from airflow.sdk.serde import deserialize, serialize
from airflow.triggers.base import TriggerEvent
from rayslice.operators.triggers import RayStepTrigger

from rayslice.client.jobs_client import AsyncRayJobsClient, JobStatus
from rayslice.client.submission import submit_step
from rayslice.core.accelerators import AcceleratorRequest
from rayslice.core.step import Owner, StepSpec
from tests.rayslice.client.test_log_stream import chatty_job, expected, payload


def chatty_sleeper():
    import time

    for i in range(3):
        print(f"line {i}", flush=True)
    time.sleep(300)


def test_serialize_round_trips_through_airflow_serde():
    trigger = RayStepTrigger(ray_conn_id="ray_x", submission_id="sid-1", poll_interval=0.5, log_offset=12,
                             resume_not_before=1234.5)
    classpath, kwargs = trigger.serialize()
    assert classpath == "rayslice.operators.triggers.RayStepTrigger"
    again = RayStepTrigger(**deserialize(serialize(kwargs)))
    assert again.serialize() == (classpath, kwargs)
    assert kwargs["log_offset"] == 12 and kwargs["ray_conn_id"] == "ray_x" and kwargs["resume_not_before"] == 1234.5


async def test_the_event_waits_for_resume_not_before(ray_default):
    """A step that ends at once still resumes its task no sooner than the operator's min_deferral allows."""
    trigger = RayStepTrigger(ray_conn_id="ray_default", submission_id="rayslice-no-such-job", poll_interval=0.1)
    started = time.time()
    await asyncio.wait_for(anext(trigger.run()), 30)
    unheld = time.time() - started
    trigger = RayStepTrigger(ray_conn_id="ray_default", submission_id="rayslice-no-such-job", poll_interval=0.1,
                             resume_not_before=time.time() + unheld + 2.0)
    event = await asyncio.wait_for(anext(trigger.run()), 30)
    assert time.time() >= trigger.resume_not_before, "the event came before resume_not_before"
    assert event.payload["error_type"] == "JobNotFoundError"  # held, not changed


async def test_unknown_job_yields_an_error_event(ray_default):
    trigger = RayStepTrigger(ray_conn_id="ray_default", submission_id="rayslice-no-such-job", poll_interval=0.1)
    event = await asyncio.wait_for(anext(trigger.run()), 30)
    assert isinstance(event, TriggerEvent)
    assert event.payload["status"] == "error" and event.payload["error_type"] == "JobNotFoundError"
    assert "rayslice-no-such-job" in event.payload["message"]


async def test_run_relays_the_log_and_on_kill_stops_the_job(ray_default, capfd):
    owner = Owner(dag_id="trigger_test", run_id=f"r{time.time_ns()}", task_id="t", try_number=1)
    spec = StepSpec.for_function(chatty_sleeper, request=AcceleratorRequest(resource="GPU", count=0.25),
                                 owner=owner)
    async with AsyncRayJobsClient(ray_default.dashboard_url, token=ray_default.token) as client:
        sid = await submit_step(client, spec)
        trigger = RayStepTrigger(ray_conn_id="ray_default", submission_id=sid, poll_interval=0.2)
        run = asyncio.ensure_future(anext(trigger.run()))
        relayed, deadline = "", time.monotonic() + 120
        while "line 2" not in relayed and time.monotonic() < deadline and not run.done():
            await asyncio.sleep(0.2)
            relayed += capfd.readouterr().out
        assert "pid=" in relayed and "line 2" in relayed, relayed[-2000:]  # host output, host-prefixed

        await trigger.cleanup()  # every trigger exit: must leave the job alone
        assert (await client.get(sid)).status == JobStatus.RUNNING

        await trigger.on_kill()  # the user killed the deferred task
        event = await asyncio.wait_for(run, 30)
        assert (await client.get(sid)).status == JobStatus.STOPPED
    assert event.payload["status"] == "error" and event.payload["submission_id"] == sid
    assert "stopped before the step finished" in event.payload["message"]
    assert event.payload["log_offset"] > 0


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _relayed_by(trigger: RayStepTrigger) -> _Lines:
    """What the trigger relays, caught by a plain logger in place of its structlog one (LoggingMixin's `_log`)."""
    handler = _Lines()
    logger = logging.getLogger(f"rayslice.tests.trigger.{uuid.uuid4().hex[:8]}")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    trigger._log = logger
    return handler


async def test_run_streams_every_line_once_and_a_restarted_trigger_resumes_at_its_offset(ray_default):
    """The log is streamed (not re-read per poll): every line once, in order; the event's offset is the log's end."""
    async with AsyncRayJobsClient(ray_default.dashboard_url, token=ray_default.token) as client:
        sid = await client.submit(chatty_job(), submission_id=f"rsls-trigger-{uuid.uuid4().hex[:8]}")
        trigger = RayStepTrigger(ray_conn_id="ray_default", submission_id=sid, poll_interval=0.5)
        handler = _relayed_by(trigger)
        event = await asyncio.wait_for(anext(trigger.run()), 120)
        log = await client.logs(sid)
    assert event.payload["status"] == "success" and event.payload["result"] == 42, event.payload
    assert payload(handler.lines) == expected()
    assert event.payload["log_complete"] is True and event.payload["log_offset"] == len(log)

    # A trigger deferred (or restarted) with an offset relays only what follows it.
    cut = log.index("payload-0200")
    again = RayStepTrigger(ray_conn_id="ray_default", submission_id=sid, poll_interval=0.5, log_offset=cut)
    resumed = _relayed_by(again)
    event = await asyncio.wait_for(anext(again.run()), 60)
    assert event.payload["result"] == 42 and payload(resumed.lines) == expected()[200:]
