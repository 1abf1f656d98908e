"""After a step ends, every host of its slice reports idle to the GCS and its demand is gone.

This is what Ray's autoscaler reads to shrink the fleet (`GetClusterResourceState`): the node's
status and idle duration, and the pending gang (placement group) requests.
"""

from __future__ import annotations

import time

import pytest

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.exceptions import CapacityTimeoutError, StepFailedError, StepTimeoutError
from rayslice.core.step import Owner, StepSpec
from tests.conftest import wait_until


def succeed():
    return 1


def fail():
    raise RuntimeError("step failed on purpose")


def hang():
    import time

    time.sleep(600)


def cluster_state(ray):
    from ray.autoscaler.v2.sdk import get_cluster_resource_state

    return get_cluster_resource_state(ray._private.worker.global_worker.gcs_client)


def host_states(ray, pod_type: str) -> dict[str, tuple[int, int]]:
    """node id -> (status, idle ms) for every host of every slice of `pod_type`."""
    return {
        node.node_id.hex(): (node.status, node.idle_duration_ms)
        for node in cluster_state(ray).node_states
        if node.labels.get("ray.io/tpu-pod-type") == pod_type
    }


def all_idle(ray, pod_type: str) -> bool:
    from ray.core.generated.autoscaler_pb2 import NodeStatus

    states = host_states(ray, pod_type)
    return bool(states) and all(status == NodeStatus.IDLE for status, _ in states.values())


def no_pending_gangs(ray) -> bool:
    return len(cluster_state(ray).pending_gang_resource_requests) == 0


def assert_idle_and_no_demand(ray) -> None:
    assert wait_until(lambda: all_idle(ray, "v6e-16"), timeout=10), host_states(ray, "v6e-16")
    assert wait_until(lambda: no_pending_gangs(ray), timeout=5)
    first = host_states(ray, "v6e-16")
    time.sleep(3)  # the raylet reports its idle time about once a second
    later = host_states(ray, "v6e-16")
    assert all(later[node][1] > first[node][1] for node in first), "idle duration must keep growing"


def spec_for(fn, **fields) -> StepSpec:
    fields.setdefault("request", TpuSliceRequest(tpu="v6e-16"))
    return StepSpec.for_function(fn, owner=Owner(submission_id=f"test-idle-{time.time_ns()}"), **fields)


@pytest.mark.parametrize(
    ("fn", "fields", "error"),
    [
        (succeed, {}, None),
        (fail, {}, StepFailedError),
        (hang, {"step_timeout": 3}, StepTimeoutError),  # the launcher kills the gang, like an Airflow kill
    ],
    ids=["success", "failure", "killed-by-timeout"],
)
def test_hosts_report_idle_after_the_step(ray_driver, fn, fields, error):
    from rayslice.cluster import run_step

    if error:
        with pytest.raises(error):
            run_step(spec_for(fn, **fields))
    else:
        run_step(spec_for(fn, **fields))
    assert_idle_and_no_demand(ray_driver)


def test_capacity_timeout_withdraws_the_whole_slice_demand(ray_driver):
    """One v6e-16 head is taken by someone else: a 2-slice request times out and withdraws everything."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from rayslice.cluster import run_step

    blocker = placement_group([{"TPU-v6e-16-head": 1}], name="someone-else")
    ray_driver.get(blocker.ready(), timeout=30)
    try:
        spec = spec_for(succeed, request=TpuSliceRequest(tpu="v6e-16", num_slices=2), capacity_timeout=3)
        with pytest.raises(CapacityTimeoutError, match="nothing was left reserved"):
            run_step(spec)
    finally:
        remove_placement_group(blocker)
    assert_idle_and_no_demand(ray_driver)
