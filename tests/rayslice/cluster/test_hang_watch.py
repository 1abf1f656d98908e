"""The simulation's hang detector: a deadlocked collective fails the step and frees the slice; a sleep does not."""

from __future__ import annotations

import re
import threading
import time

import pytest

from rayslice.cluster import hang_watch
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.exceptions import CollectiveHangError
from rayslice.core.step import Owner, StepSpec
from tests.rayslice.cluster.test_launcher import assert_all_released


def skip_a_collective_on_host_1():
    """Every host joins one all-gather; then host 1 skips the second, so its peers never leave it (a deadlock).

    (Skipping the very first collective is no hang: the gloo context's set-up fails after 30 s.)
    """
    import os

    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    multihost_utils.process_allgather(jnp.ones(1))
    if os.environ["TPU_WORKER_ID"] != "1":
        multihost_utils.process_allgather(jnp.ones(1))
    return 0


def sleep_in_python(seconds: float):
    """Idle for a while in plain Python on every host: no CPU, but not inside JAX."""
    import time

    time.sleep(seconds)
    return "slept"


def run(request, fn, **fields):
    from rayslice.cluster import run_step

    return run_step(StepSpec.for_function(fn, request=request, owner=Owner(submission_id=f"test-{time.time_ns()}"),
                                          **fields))


def test_a_collective_no_peer_joins_fails_as_a_hang_and_frees_the_slice(ray_driver):
    # step_timeout only keeps a broken detector from hanging the suite; it must not be what fires.
    with pytest.raises(CollectiveHangError, match="collective hang") as info:
        run(TpuSliceRequest(tpu="v6e-16"), skip_a_collective_on_host_1, hang_timeout=5, step_timeout=120)
    message = str(info.value)
    print(message)
    for worker in range(4):  # every host named, on whichever v6e-16 the step got
        assert re.search(rf"v6e-16-[ab]/host{worker} \(slice 0, worker {worker}\b", message), message
    assert "process_allgather" in message  # where the stuck hosts are blocked
    assert re.search(r"already returned from the step: v6e-16-[ab]/host1 ", message), message  # the one that skipped
    assert_all_released(ray_driver)


def test_a_step_idle_in_plain_python_is_not_a_hang(ray_driver):
    assert run(TpuSliceRequest(tpu="v6e-4"), sleep_in_python, kwargs={"seconds": 6}, hang_timeout=2) == ["slept"]
    assert_all_released(ray_driver)


def test_only_a_thread_blocked_inside_jax_counts():
    started, release = threading.Event(), threading.Event()

    def plain_python_wait():
        started.set()
        release.wait()

    thread = threading.Thread(target=plain_python_wait)
    thread.start()
    try:
        started.wait()
        assert hang_watch.jax_frame(thread.ident) is None
    finally:
        release.set()
        thread.join()


def test_every_host_must_be_idle_at_once():
    idle = [hang_watch.HostState("a", 100.0, "f"), hang_watch.HostState("b", 130.0, "g")]
    assert hang_watch.all_idle_for(idle, now=160.0) == 30.0  # since the last one went idle
    assert hang_watch.all_idle_for([*idle, hang_watch.HostState("c", None, None)], now=160.0) == 0.0
    assert hang_watch.all_idle_for([], now=160.0) == 0.0
