"""rayslice's Ray metrics: what a driver sends, and what Ray's Prometheus endpoint then shows."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from rayslice.cluster import metrics
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.step import StepSpec
from tests.conftest import wait_until


class Captured:
    """A recorder stand-in: what `Sender` would send, by method."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, method: str):
        sender = self

        class Remote:
            @staticmethod
            def remote(*args):
                sender.calls.append((method, args))

        return Remote


@pytest.fixture
def captured(monkeypatch):
    monkeypatch.setattr(metrics.ray, "is_initialized", lambda: True)
    recorder = Captured()
    monkeypatch.setattr(metrics, "recorder", lambda: recorder)
    return recorder


def test_an_attempt_sends_each_phase_as_seconds_after_the_one_before(captured):
    spec = StepSpec.for_function(len, request=TpuSliceRequest(tpu="v6e-16"))
    times = {"accepted": 100.0, "driver_started": 101.5, "reserved": 104.0, "released": 110.0}
    metrics.Sender().attempt(spec, times, queue_wait=2.0)
    assert captured.calls == [("attempt", ("v6e-16", {"driver_started": 1.5, "reserved": 2.5, "released": 6.0}, 2.0))]


def test_an_unknown_error_type_is_counted_as_other_so_tags_stay_bounded(captured):
    spec = StepSpec.for_function(len, request=AcceleratorRequest(resource="GPU", count=0.5))
    sender = metrics.Sender()
    sender.step(spec, "failed", "CapacityTimeoutError")
    sender.step(spec, "failed", "SomethingAStepMadeUp")
    assert captured.calls == [("step", ("GPU", "failed", "CapacityTimeoutError")),
                              ("step", ("GPU", "failed", "other"))]


def test_queue_gauges_count_waiting_steps_and_the_chips_admitted_ones_hold():
    entries = [{"kind": "v6e-16", "chips": 32, "admitted": True}, {"kind": "v6e-16", "chips": 16, "admitted": False},
               {"kind": "v6e-16", "chips": 16, "admitted": False}, {"kind": "GPU", "chips": 0.5, "admitted": True}]
    assert metrics.queue_gauges(entries) == ({"v6e-16": 2}, {"v6e-16": 32, "GPU": 0.5})


def test_without_a_ray_nothing_is_sent_and_nothing_starts(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a driver without Ray, whatever ran before
    monkeypatch.setattr(metrics, "recorder", lambda: pytest.fail("no Ray: the recorder must not be looked up"))
    sender = metrics.Sender()
    sender.step(StepSpec.for_function(len, request=TpuSliceRequest(tpu="v6e-4")), "succeeded")
    sender.flush()


def counts_one():
    import time

    time.sleep(metrics.QUEUE_POLL_S + 1)  # held across one of the recorder's samples of the queue
    return 1


def fails():
    raise ValueError("on purpose")


def prometheus_samples(ray_driver) -> dict[tuple[str, frozenset], float]:
    """Every rayslice sample on every node's metrics export port, by (name, labels), summed over Ray's own labels."""
    from prometheus_client.parser import text_string_to_metric_families

    from rayslice.local.local_cluster import NODE_IP

    ours = {"kind", "outcome", "error", "phase", "le", "category"}
    samples: dict[tuple[str, frozenset], float] = {}
    for node in ray_driver.nodes():
        if not node["Alive"] or not node.get("MetricsExportPort"):
            continue
        try:
            text = httpx.get(f"http://{NODE_IP}:{node['MetricsExportPort']}/metrics", timeout=10).text
        except httpx.HTTPError:
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("ray_rayslice_"):
                    key = (sample.name, frozenset((k, v) for k, v in sample.labels.items() if k in ours))
                    samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_a_steps_metrics_reach_the_clusters_prometheus_endpoint(cluster, ray_driver):
    """Two real steps (one fails) as Ray jobs; their counts and phases appear on the endpoint Prometheus scrapes."""
    from rayslice.client.submission import run_step_job
    from rayslice.core.exceptions import StepFailedError

    before = prometheus_samples(ray_driver)
    gpu = AcceleratorRequest(resource="GPU", count=0.25)

    async def both():
        return await asyncio.gather(
            run_step_job(cluster.dashboard_url, StepSpec.for_function(counts_one, request=gpu), token=cluster.token,
                         emit=lambda _: None),
            run_step_job(cluster.dashboard_url, StepSpec.for_function(fails, request=gpu), token=cluster.token,
                         emit=lambda _: None),
            return_exceptions=True)

    ok, failed = asyncio.run(both())
    assert ok == 1 and isinstance(failed, StepFailedError), (ok, failed)

    def grew(after, name, by, **labels):  # at least: a step of an earlier test may report after `before`
        return value(after, name, **labels) - value(before, name, **labels) >= by

    expected = [("ray_rayslice_steps_total", 1, {"kind": "GPU", "outcome": "succeeded"}),
                ("ray_rayslice_steps_total", 1, {"kind": "GPU", "outcome": "failed"}),
                ("ray_rayslice_step_failures_total", 1, {"kind": "GPU", "error": "StepFailedError"}),
                ("ray_rayslice_phase_seconds_count", 2, {"kind": "GPU", "phase": "released"}),
                ("ray_rayslice_queue_wait_seconds_count", 2, {"kind": "GPU"})]
    deadline = time.monotonic() + 90  # Ray reports every RAY_metrics_report_interval_ms (10 s by default)
    while True:
        after = prometheus_samples(ray_driver)
        missing = [(name, labels) for name, by, labels in expected if not grew(after, name, by, **labels)]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not missing, f"not (yet) on the endpoint: {missing}; ours: {sorted(k[0] for k in after)}"
    # Goodput: both steps' chip-seconds by category; the one that worked for QUEUE_POLL_S + 1 s was productive.
    def chip_s(samples, category):
        return value(samples, "ray_rayslice_chip_seconds_total", kind="GPU", category=category)

    assert chip_s(after, "productive") - chip_s(before, "productive") >= 0.25 * (metrics.QUEUE_POLL_S + 1)
    assert chip_s(after, "startup") > chip_s(before, "startup")
    assert 0 < value(after, "ray_rayslice_goodput", kind="GPU") <= 1
    # The queue is sampled every QUEUE_POLL_S and the first step outlasted one: GPU has a series; nothing holds it now.
    def held_now():
        samples = prometheus_samples(ray_driver)
        return ("ray_rayslice_chips_held", frozenset({("kind", "GPU")})) in samples and value(
            samples, "ray_rayslice_chips_held", kind="GPU") == 0

    assert wait_until(held_now, timeout=30, interval=2)
    assert value(prometheus_samples(ray_driver), "ray_rayslice_queue_depth", kind="GPU") == 0
