"""rayslice's Airflow metrics go through Airflow's own Stats, with bounded tags, and never fail a task."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from airflow.sdk.observability import stats
from airflow.triggers.base import TriggerEvent
from rayslice.operators import metrics
from rayslice.operators.triggers import RayStepTrigger


@pytest.fixture
def recorded(monkeypatch):
    calls: list[tuple] = []
    monkeypatch.setattr(stats, "incr", lambda name, *a, tags=None: calls.append(("incr", name, tags)))
    monkeypatch.setattr(stats, "timing", lambda name, dt, *, tags=None: calls.append(("timing", name, dt, tags)))
    return calls


def test_submissions_deferrals_and_waits_are_airflow_stats(recorded):
    metrics.submitted("worker")
    metrics.deferred("triggerer")
    metrics.waited(2.5, where="worker", outcome="success")
    assert recorded == [("incr", "rayslice.submissions", {"where": "worker"}),
                        ("incr", "rayslice.deferrals", {"where": "triggerer"}),
                        ("timing", "rayslice.wait", timedelta(seconds=2.5), {"where": "worker", "outcome": "success"})]


def test_the_triggers_wait_is_timed_with_its_outcome(recorded):
    trigger = RayStepTrigger(ray_conn_id="ray_x", submission_id="sid-1")

    async def ends_in_error():
        await asyncio.sleep(0.2)
        yield TriggerEvent({"status": "error", "submission_id": "sid-1"})

    trigger._follow_job = ends_in_error
    event = asyncio.run(anext(trigger._follow()))
    assert event.payload["status"] == "error"
    [(kind, name, waited, tags)] = recorded
    assert (kind, name, tags) == ("timing", "rayslice.wait", {"where": "triggerer", "outcome": "error"})
    assert timedelta(seconds=0.2) <= waited < timedelta(seconds=5)


def test_a_broken_metrics_setup_never_fails_the_task(monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("statsd host unknown")

    monkeypatch.setattr(stats, "incr", broken)
    monkeypatch.setattr(stats, "timing", broken)
    metrics.submitted("worker")
    metrics.waited(1.0, where="worker", outcome="success")
