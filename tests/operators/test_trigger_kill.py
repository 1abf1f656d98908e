"""A cancelled trigger stops its job only when its task was stopped (issue 36, item 7).

`on_kill()` runs both when the user stops a deferred task and when the trigger only moved to another
triggerer. A task state that cannot be read must not be taken for a kill (a moved trigger's job is
still followed); a kill that lands while the job is being submitted stops that job once Ray has it.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from airflow.sdk.execution_time import task_runner
from rayslice.operators import triggers
from rayslice.operators.triggers import RayStepTrigger

from rayslice.core.exceptions import JobNotFoundError


class Jobs:
    """The Ray Jobs client: a job Ray only knows after `unknown_for` stop calls."""

    def __init__(self, unknown_for: int = 0) -> None:
        self.unknown_for, self.stops = unknown_for, 0

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def stop(self, sid: str) -> bool:
        self.stops += 1
        if self.stops <= self.unknown_for:
            raise JobNotFoundError(f"no job {sid}")
        return True


class Unanswered:
    """The triggerer's channel to Airflow, which does not answer (an API server restarting)."""

    def __init__(self) -> None:
        self.asked = 0

    async def asend(self, msg):
        self.asked += 1
        raise ConnectionError("execution API unreachable")


def _trigger(jobs: Jobs, monkeypatch: pytest.MonkeyPatch) -> RayStepTrigger:
    trigger = RayStepTrigger(ray_conn_id="ray_default", submission_id="sid-1", call_timeout=3)
    settings = SimpleNamespace(async_client=lambda: jobs)

    async def asettings():
        return settings

    monkeypatch.setattr(trigger, "_hook", lambda: SimpleNamespace(asettings=asettings))
    trigger._task_instance = SimpleNamespace(dag_id="d", run_id="r", task_id="t", map_index=-1)
    return trigger


def test_a_state_airflow_does_not_give_leaves_the_job_running(monkeypatch):
    channel, jobs = Unanswered(), Jobs()
    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", channel, raising=False)
    waits, sleep = [], asyncio.sleep

    async def no_wait(delay, *args, **kwargs):  # the pauses between asks (3 s in all) are not what this is about
        waits.append(delay)
        await sleep(0)

    monkeypatch.setattr(asyncio, "sleep", no_wait)
    asyncio.run(_trigger(jobs, monkeypatch).on_kill())
    assert channel.asked == 3 and len(waits) >= 2 and all(w > 0 for w in waits)  # asked again, after a pause
    assert jobs.stops == 0


def test_a_kill_during_submission_stops_the_job_once_ray_has_it(monkeypatch):
    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", None, raising=False)  # no triggerer: a kill
    monkeypatch.setattr(triggers, "SUBMIT_GRACE_S", 5.0, raising=False)
    jobs = Jobs(unknown_for=2)
    asyncio.run(_trigger(jobs, monkeypatch).on_kill())
    assert jobs.stops == 3


def test_a_kill_of_a_job_never_submitted_ends(monkeypatch):
    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", None, raising=False)
    monkeypatch.setattr(triggers, "SUBMIT_GRACE_S", 1.0, raising=False)
    jobs = Jobs(unknown_for=10**6)
    asyncio.run(_trigger(jobs, monkeypatch).on_kill())
    assert 2 <= jobs.stops <= 4
