"""Ray's own autoscaler (v2, fake multi-node provider) adds a whole slice for a step and removes it after.

A cluster of its own that starts with zero TPU hosts (`rayslice.local.local_autoscaler`: a v6e-4
type and a 2-host v4-16, min 0, idle timeout 12 s). Steps go through the Jobs API
(`run_step_job`), since this test process may already be a Ray driver of the main test cluster.
The baseline is a long-lived Ray job that reserves a slice with `SlicePlacementGroup`, runs on
it with `run_on_slice` and never removes the group: the autoscaler must keep that host.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time

import pytest

from rayslice.client.jobs_client import RayJobsClient
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_autoscaler
from tests.conftest import private_cluster

IDLE_MINUTES = 0.2
IDLE_S = IDLE_MINUTES * 60
GRACE = 30.0  # the bound: removed within idle timeout + 30 s

LEAKY_DRIVER = textwrap.dedent(
    """
    import time
    import ray
    from ray.util.tpu import SlicePlacementGroup, run_on_slice

    @ray.remote
    def device_count():
        import jax
        return jax.device_count()

    ray.init()
    handle = SlicePlacementGroup(
        topology="2x2", accelerator_version="v6e", bundle_label_selector=[{"ray.io/tpu-pod-type": "v6e-4"}]
    )
    print("LEAKY-RESULT", ray.get(run_on_slice(device_count, tpu_slice=handle)), flush=True)
    time.sleep(600)  # a long-lived driver that never removes its placement group
    """
)


@pytest.fixture(scope="module")
def autoscaling_cluster(tmp_path_factory: pytest.TempPathFactory):
    def start():
        return local_autoscaler.up(("v6e-4", "v4-16"), name="autoscaling", idle_timeout_minutes=IDLE_MINUTES)

    with private_cluster(tmp_path_factory.mktemp("autoscaling-home"), "autoscaling", start) as record:
        yield record


def count_devices():
    import jax

    return jax.device_count()


def _pod_type_hosts(alive: dict[str, dict], pod_type: str) -> set[str]:
    return {node_id for node_id, labels in alive.items() if labels.get("ray.io/tpu-pod-type") == pod_type}


@pytest.mark.parametrize("pod_type", ["v4-16"])  # a whole 2-host slice; v6e-4 runs in the bench (CI time)
def test_the_autoscaler_adds_a_slice_for_a_step_and_removes_it_after_but_keeps_a_leaked_reservations_host(
        autoscaling_cluster, pod_type, tmp_path):
    """One pass over idle hosts proves both: the step's slice is removed, the leaked v6e-4 host is kept.

    The leaky driver's v6e-4 host has run its last task before the step's slice is even added, so
    had its reservation not counted, it would have been idle longer than the step's hosts: the
    autoscaler's removal of those (a positive wait) is the moment it would have gone too. It goes
    only once the driver ends, a full idle timeout after (its idle time counts from then).
    `pod_type` must not be v6e-4: the cluster holds one host of each type.
    """
    from rayslice.client.submission import run_step_job

    script = tmp_path / "leaky_driver.py"
    script.write_text(LEAKY_DRIVER)
    sid = f"leaky-{time.time_ns()}"
    request = TpuSliceRequest(tpu=pod_type)
    with (
        local_autoscaler.NodeWatcher(autoscaling_cluster) as watcher,
        RayJobsClient(autoscaling_cluster.dashboard_url) as client,
    ):
        assert watcher.alive == {}, "the cluster must start with zero TPU hosts"
        client.submit(f"{sys.executable} {script}", submission_id=sid)
        try:
            deadline = time.monotonic() + 240
            while "LEAKY-RESULT" not in client.logs(sid) and time.monotonic() < deadline:
                assert not client.get(sid).status.is_terminal, client.logs(sid)
                time.sleep(1)
            assert "LEAKY-RESULT [1]" in client.logs(sid)  # ran on the host (1 CPU device: no simulated-TPU setup)
            leaked_at = watcher.now()  # its host's last task has ended: idle but for the reservation
            [leaked] = [e for e in watcher.events if e.kind == "added"]
            assert leaked.labels["ray.io/tpu-pod-type"] == "v6e-4"

            spec = StepSpec.for_function(
                count_devices, request=request, capacity_timeout=240, owner=Owner(run_id=f"as-{time.time_ns()}")
            )
            result = asyncio.run(run_step_job(autoscaling_cluster.dashboard_url, spec, emit=print))
            done = watcher.now()
            removed = watcher.wait(lambda alive: not _pod_type_hosts(alive, pod_type), timeout=IDLE_S + GRACE)
            removed_after = watcher.now() - done
            assert result == [request.chips_per_host * request.hosts_per_slice] * request.hosts_per_slice
            added = [e for e in watcher.events if e.kind == "added" and e.node_id != leaked.node_id]
            # The whole slice, and only it, with the labels rayslice schedules on (from the node-type config).
            assert sorted(e.labels["ray.io/tpu-worker-id"] for e in added) == \
                [str(i) for i in range(request.hosts_per_slice)]
            assert {e.labels["ray.io/tpu-pod-type"] for e in added} == {pod_type}
            assert {e.labels["ray.io/tpu-slice-name"] for e in added} == {f"{pod_type}-a"}
            assert removed, f"{len(_pod_type_hosts(watcher.alive, pod_type))} host(s) still up " \
                            f"{removed_after:.0f} s after the step"
            assert leaked.node_id in watcher.alive, "the autoscaler removed a host whose slice is still reserved"
            assert {e.node_id for e in watcher.events if e.kind == "removed"} == {e.node_id for e in added}
            step_removed_at = max(e.t for e in watcher.events if e.kind == "removed")
            print(f"v6e-4 host idle but reserved since {leaked_at:.1f} s; step's hosts removed at "
                  f"{step_removed_at:.1f} s")
            # What makes that removal the witness: the v6e-4 host had been idle past the idle timeout by then.
            assert step_removed_at - leaked_at >= IDLE_S, (leaked_at, step_removed_at)
        finally:
            stopped_at = watcher.now()
            client.stop(sid)  # the driver exits; Ray removes the placement groups it created
        assert watcher.wait(lambda alive: not alive, timeout=IDLE_S + GRACE), "host kept after the driver ended"
    [gone] = [e for e in watcher.events if e.kind == "removed" and e.node_id == leaked.node_id]
    print(f"driver stopped at {stopped_at:.1f} s; v6e-4 host removed at {gone.t:.1f} s")
    # Not removed alongside the step's hosts (a moment late): its idle time began when the driver ended.
    assert gone.t - stopped_at >= IDLE_S, (stopped_at, gone.t)


def test_a_request_no_node_group_can_hold_is_refused_at_once(autoscaling_cluster):
    """Issue 38 (4): every kind counted as one the autoscaler may add, so these waited out capacity_timeout.

    The cluster reports its node groups (a v6e-4, and one 2-host v4-16, each at most one) to Ray: a
    v6e-16, which no group provides, fails before it queues; two v4-16 slices, more than the group can
    ever hold, are refused by the queue.
    """
    from rayslice.client.submission import run_step_job
    from rayslice.core.exceptions import UnsatisfiableRequestError

    for request, said in ((TpuSliceRequest(tpu="v6e-16"), "v6e-16 can never be scheduled"),
                          (TpuSliceRequest(tpu="v4-16", num_slices=2), "at most 1 v4-16")):
        spec = StepSpec.for_function(count_devices, request=request, capacity_timeout=600,
                                     owner=Owner(run_id=f"as-{time.time_ns()}"))
        with pytest.raises(UnsatisfiableRequestError, match=said):
            asyncio.run(run_step_job(autoscaling_cluster.dashboard_url, spec, emit=print))
