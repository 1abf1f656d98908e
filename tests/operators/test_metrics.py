"""rayslice's Airflow metrics go through Airflow's own Stats, with bounded tags, and never fail a task."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from airflow.sdk.observability import stats
from airflow.triggers.base import TriggerEvent
from rayslice.operators import metrics
from rayslice.operators.triggers import RayStepTrigger


class Backend:
    """A StatsD / OTel stand-in behind Airflow's own `stats` module: what reaches the backend."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def incr(self, stat, count=1, rate=1, *, tags=None):
        self.calls.append(("incr", stat, tags))

    def timing(self, stat, dt, *, tags=None):
        self.calls.append(("timing", stat, dt, tags))


@pytest.fixture
def recorded():
    from airflow.sdk._shared.observability.metrics import stats as shared

    backend = Backend()
    previous = shared._factory, shared._export_legacy_names
    stats.initialize(factory=lambda: backend, export_legacy_names=True)  # as Airflow's processes set it up
    yield backend.calls
    shared._factory, shared._backend, shared._export_legacy_names = previous[0], None, previous[1]


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
