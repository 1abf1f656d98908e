"""The launcher on a real local cluster: real Ray placement groups, real multi-process JAX with gloo."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import pytest

from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.exceptions import HostLostError, PreemptedError, StepFailedError
from rayslice.core.step import Owner, StepSpec
from tests.conftest import TOTAL_TPU_CHIPS, wait_until


def device_count_and_allgather():
    """Each host reports the devices JAX sees and a real cross-host collective result."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(jnp.array([jax.process_index()]))
    return [jax.device_count(), int(np.asarray(gathered).sum())]


def raise_on_host_2():

    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    if os.environ["TPU_WORKER_ID"] == "2":
        raise ValueError("bad batch on host 2")
    multihost_utils.process_allgather(jnp.ones(1))  # peers block here until the gang is cancelled
    return jax.device_count()


def die_on_host_1():

    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    if os.environ["TPU_WORKER_ID"] == "1":
        os._exit(17)
    multihost_utils.process_allgather(jnp.ones(1))
    return 0


def wait_for_peers(folder: str, expected: int):
    """Proves concurrency: returns only once `expected` steps are inside this function together."""
    import time
    import uuid

    Path(folder, uuid.uuid4().hex).touch()
    deadline = time.monotonic() + 120
    while len(os.listdir(folder)) < expected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(os.listdir(folder))} of {expected} steps ran at the same time")
        time.sleep(0.05)
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def run(request, fn, **kwargs):
    from rayslice.cluster import run_step

    spec = StepSpec.for_function(
        fn, request=request, kwargs=kwargs, owner=Owner(submission_id=f"test-{time.time_ns()}")
    )
    return run_step(spec)


def our_placement_groups(ray):
    from ray.util import placement_group_table

    return [
        pg
        for pg in placement_group_table().values()
        if pg["name"].startswith("rayslice:test-") and pg["state"] != "REMOVED"
    ]


def assert_all_released(ray):
    """All TPU chips available again within 1 s, and none of our placement groups left."""
    assert wait_until(lambda: ray.available_resources().get("TPU") == TOTAL_TPU_CHIPS, timeout=1.0), (
        ray.available_resources().get("TPU")
    )
    assert our_placement_groups(ray) == []


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (TpuSliceRequest(tpu="v6e-4"), [[4, 0]]),
        (TpuSliceRequest(tpu="v6e-16"), [[16, 6]] * 4),  # process ids 0..3 gathered from every host
        (TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True), [[32, 28]] * 8),
        (TpuSliceRequest(tpu="v6e-16", num_slices=2), [[16, 6]] * 8),  # two independent JAX groups
    ],
    ids=["v6e-4", "v6e-16", "2xv6e-16-multislice", "2xv6e-16-independent"],
)
def test_device_count_across_the_slice(ray_driver, request_, expected):
    assert run(request_, device_count_and_allgather) == expected
    assert_all_released(ray_driver)


def test_first_host_error_cancels_the_gang(ray_driver):
    started = time.monotonic()
    with pytest.raises(StepFailedError, match="bad batch on host 2") as info:
        run(TpuSliceRequest(tpu="v6e-16"), raise_on_host_2)
    elapsed = time.monotonic() - started
    assert info.value.worker_id == 2
    assert "host2" in str(info.value) and "ValueError" in str(info.value)
    # Without cancellation the peers would wait in the collective for JAX's 300 s barrier.
    assert elapsed < 60, f"gang took {elapsed:.1f} s to fail"
    assert_all_released(ray_driver)


def test_host_process_death_fails_the_step(ray_driver):
    with pytest.raises(HostLostError, match="host1") as info:
        run(TpuSliceRequest(tpu="v6e-16"), die_on_host_1)
    assert info.value.worker_id == 1
    assert not isinstance(info.value, PreemptedError)  # its node's raylet is alive: not a preemption
    assert_all_released(ray_driver)


def _concurrently(requests, fn, **kwargs):
    results, errors = [None] * len(requests), []

    def one(i, request):
        try:
            results[i] = run(request, fn, **kwargs)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results


def test_half_gpus_pack_one_device_before_the_next(ray_driver):
    with tempfile.TemporaryDirectory() as folder:
        devices = _concurrently(
            [AcceleratorRequest(resource="GPU", count=0.5)] * 3, wait_for_peers, folder=folder, expected=3
        )
    assert sorted(devices) == ["0", "0", "1"]
    assert wait_until(lambda: ray_driver.available_resources().get("GPU") == 3.0)


def test_four_quarter_gpus_share_one_gpu(ray_driver):
    with tempfile.TemporaryDirectory() as folder:
        devices = _concurrently(
            [AcceleratorRequest(resource="GPU", count=0.25)] * 4, wait_for_peers, folder=folder, expected=4
        )
    assert len(set(devices)) == 1
    assert wait_until(lambda: ray_driver.available_resources().get("GPU") == 3.0)


def test_fraction_step_gets_a_jax_memory_share(ray_driver):
    def memory_fraction():

        return os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")

    assert run(AcceleratorRequest(resource="GPU", count=0.25), memory_fraction) == "0.237"


def test_results_come_in_slice_then_worker_order(ray_driver):
    def whoami():

        return [os.environ["TPU_NAME"], int(os.environ["TPU_WORKER_ID"])]

    hosts = run(TpuSliceRequest(tpu="v6e-16", num_slices=2), whoami)
    assert [worker for _, worker in hosts] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert len({name for name, _ in hosts[:4]}) == 1 and hosts[0][0] != hosts[4][0]
    assert_all_released(ray_driver)


def test_step_timeout_releases_the_slice(ray_driver):
    from rayslice.cluster import run_step
    from rayslice.core.exceptions import StepTimeoutError

    def hang():
        import time

        time.sleep(600)

    spec = StepSpec.for_function(
        hang,
        request=TpuSliceRequest(tpu="v6e-4"),
        step_timeout=5,
        owner=Owner(submission_id=f"test-{time.time_ns()}"),
    )
    with pytest.raises(StepTimeoutError, match="v6e-4-a/host0"):
        run_step(spec)
    assert_all_released(ray_driver)


def test_capacity_timeout_leaves_nothing_reserved(ray_driver):
    """Two v6e-16 slices exist but one is busy: the step waits, times out, and holds nothing afterwards."""
    from rayslice.cluster import run_step
    from rayslice.cluster.reservation import reserve_slices
    from rayslice.core.exceptions import CapacityTimeoutError

    busy = reserve_slices(TpuSliceRequest(tpu="v6e-16"), timeout=60, name=f"rayslice:test-busy-{time.time_ns()}")
    try:
        spec = StepSpec.for_function(
            device_count_and_allgather,
            request=TpuSliceRequest(tpu="v6e-16", num_slices=2),
            capacity_timeout=3,
            owner=Owner(submission_id=f"test-{time.time_ns()}"),
        )
        with pytest.raises(CapacityTimeoutError, match="nothing was left reserved"):
            run_step(spec)
        # only the busy slice is held: the timed-out request gave back whatever it had claimed
        assert wait_until(lambda: ray_driver.available_resources().get("TPU") == TOTAL_TPU_CHIPS - 16, timeout=1.0)
    finally:
        busy.release()
    assert_all_released(ray_driver)


@pytest.mark.parametrize(
    "request_",
    [TpuSliceRequest(tpu="v6e-32"), TpuSliceRequest(tpu="v6e-4", num_slices=2)],
    ids=["no-such-pod-type", "more-slices-than-exist"],
)
def test_a_request_no_node_could_hold_fails_at_once(ray_driver, request_):
    from rayslice.core.exceptions import UnsatisfiableRequestError

    started = time.monotonic()
    with pytest.raises(UnsatisfiableRequestError, match="can never be scheduled"):
        run(request_, device_count_and_allgather)
    assert time.monotonic() - started < 30  # not the 600 s capacity_timeout
    assert_all_released(ray_driver)


@pytest.mark.parametrize(
    ("cause", "may_be_a_death"),
    [
        ("ValueError: bad batch on host 2", False),
        ("RuntimeError: Closing over jax.Array that spans non-addressable devices is not allowed", False),
        ("JaxRuntimeError: UNKNOWN: Gloo AllGather failed: [pair.cc:538] Read error: Connection reset by peer", True),
        ("XlaRuntimeError: DEADLINE_EXCEEDED: Barrier timed out", True),
        ("RuntimeError: UNAVAILABLE: failed to connect to all addresses (coordination service)", True),
    ],
)
def test_only_runtime_failures_wait_to_blame_a_dead_peer(cause, may_be_a_death):
    """A step's own exception fails the gang at once; a broken collective first asks Ray who died."""
    from rayslice.cluster.host_loss import may_be_a_peers_death

    assert may_be_a_peers_death(StepFailedError("step failed", cause=cause)) is may_be_a_death


SLOW_COORDINATOR_DRIVER = """
import json, sys
import ray
from rayslice import StepSpec, TpuSliceRequest
from rayslice.cluster import run_step
from tests.rayslice.cluster.test_launcher import process_0_works_on

ray.init(address=sys.argv[1], logging_level="ERROR", runtime_env={"env_vars": {"RAYSLICE_JAX_SHUTDOWN_TIMEOUT_S": "2"}})
try:
    print(json.dumps(run_step(StepSpec.for_function(process_0_works_on, request=TpuSliceRequest(tpu="v6e-16")))))
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def process_0_works_on():
    """Process 0 goes on working (an upload) past the group's shutdown timeout after the others returned.

    Twice the driver's 2 s timeout: hosts that left the group as each returned would time out at its
    barrier 2 s before process 0 reached it.
    """
    import time

    import jax

    if jax.process_index() == 0:
        time.sleep(4)
    return jax.process_index()


def test_a_coordinator_that_works_on_past_the_shutdown_timeout_still_succeeds(cluster, tmp_path):
    """Leaving the JAX group (a barrier) never turns a step that returned everywhere into a failure."""
    import json
    import subprocess
    import sys

    from tests.airflow_env import REPO

    env = {**os.environ, **cluster.ray_env(), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", SLOW_COORDINATOR_DRIVER, cluster.gcs_address], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [0, 1, 2, 3], done.stdout[-3000:]


def test_hosts_that_do_not_start_in_time_on_live_nodes_fail_without_the_node_death_window(ray_driver):
    """A live but slow host is one probe of its raylet, not NODE_DEATH_WINDOW_S of watching."""
    from rayslice.cluster import gang, host_loss, host_process
    from rayslice.cluster.environments import HostPlan
    from rayslice.core.exceptions import HostLostError, PreemptedError

    node = next(n for n in ray_driver.nodes() if n["Alive"] and n["Resources"].get("GPU"))
    never = host_process.HostProcess.options(resources={"no-such-resource": 1}).remote("never/host0")
    plan = HostPlan(slice_index=0, slice_name="never", worker_id=0, ip=node["NodeManagerAddress"], process_id=0,
                    num_processes=1, coordinator="", megascale_coordinator="", node_id=node["NodeID"])
    started = time.monotonic()
    with pytest.raises(HostLostError, match="did not start within 2 s") as info:
        gang.await_started([never], [plan], timeout=2)
    assert not isinstance(info.value, PreemptedError)
    assert time.monotonic() - started < host_loss.NODE_DEATH_WINDOW_S  # old code watched the live node that long


def saves_once_then_works():
    """One reported checkpoint of ~1 s, then ~1 s of work: the step's goodput line must say which was which."""
    import time

    from rayslice import get_step_context

    with get_step_context().checkpointing():
        time.sleep(1.0)
    time.sleep(1.0)
    return "ok"


def test_a_steps_goodput_adds_up_to_the_chip_time_its_timeline_held(ray_driver, capfd):
    from rayslice.cluster.phases import parse_phases
    from rayslice.core.goodput import HELD, parse_record, step_account

    assert run(TpuSliceRequest(tpu="v6e-4"), saves_once_then_works) == ["ok"]
    out = capfd.readouterr().out
    [record] = parse_phases(out)
    figures = parse_record(out)
    assert figures is not None and record["chips"] == 4 and record["outcome"] == "succeeded"
    [[start, end]] = record["spans"]["checkpointing"]
    assert end - start >= 1.0 and figures.seconds["checkpointing"] == pytest.approx(end - start, abs=1e-3)
    assert figures.seconds["productive"] >= 1.0 and figures.seconds["lost"] == 0
    held = (record["released"] - record["reserved"]) * 4
    assert figures.held_chip_s == pytest.approx(held, rel=1e-3)
    assert sum(figures.chip_s[c] for c in HELD) == pytest.approx(held, rel=0.01)
    assert figures.goodput == pytest.approx(step_account([record]).goodput, rel=1e-3)  # the record's 4 decimals
    [line] = [line for line in out.splitlines() if line.startswith("[rayslice] goodput: ")]
    assert "checkpointing 1." in line and "productive" in line
    assert_all_released(ray_driver)
