"""The admission queue on the real test cluster (two v6e-16, one v6e-4, 3 GPUs): the real broker actor.

The places here are launchers' places taken from the test's driver (no placement groups: an
admitted place counts against its capacity until it leaves, which is what the broker orders by).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rayslice.cluster import queue
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.queue import QueueSettings, entry_for
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(300)


def place(name, settings, tpu="v6e-16", slices=1, priority=0, team=None, arrival=None):
    """A launcher's place; `settings`: the operator's (set as `rayslice queue --set` does) before it joins."""
    if settings is not None and queue.snapshot()["settings"] != settings.model_dump():
        operator_sets(settings)
    entry = entry_for(TpuSliceRequest(tpu=tpu, num_slices=slices), id=f"test-{name}-{time.time_ns()}",
                      label=f"test.{name}", priority=priority, team=team, arrival=arrival)
    return queue.Place(entry, log=lambda message: None).join()


def operator_sets(settings):
    import ray

    ray.get(queue.broker().set_settings.remote(settings.model_dump()), timeout=10)


def admitted(*places):
    return [p.entry.label.split(".")[1] for p in places if p.admitted.is_set()]


def settle():
    time.sleep(3 * queue.HEARTBEAT_S)  # every place has heartbeated since the last change


def leave_all(*places):
    for p in places:
        p.leave()


@pytest.fixture
def empty_queue(ray_driver):
    assert wait_until(lambda: queue.snapshot()["entries"] == [], timeout=queue.EXPIRE_S + 3)
    yield
    operator_sets(QueueSettings())  # the cluster's defaults again, for the rest of the session
    assert wait_until(lambda: queue.snapshot()["entries"] == [], timeout=queue.EXPIRE_S + 3)


def test_policies_priority_aging_and_team_quotas(empty_queue, cluster):
    best_effort, strict = QueueSettings(), QueueSettings(policy="strict")
    run = [place(f"run{i}", best_effort) for i in range(2)]  # both v6e-16 slices
    assert wait_until(lambda: admitted(*run) == ["run0", "run1"], timeout=5)
    big = place("big", best_effort, slices=2)
    small = place("small", best_effort)
    tiny = place("tiny", best_effort, tpu="v6e-4")  # best-effort: capacity the big one cannot use
    assert wait_until(lambda: admitted(tiny) == ["tiny"], timeout=5)
    tiny.leave()
    run[0].leave()  # one slice free: the one-slice request behind the big one must not take it
    settle()
    assert admitted(big, small) == []
    state = small.state
    assert (state["rank"], state["ahead"]["label"]) == (2, "test.big"), state
    strict_tiny = place("strict-tiny", strict, tpu="v6e-4")  # strict: still no slice the big one could use
    assert wait_until(lambda: admitted(strict_tiny) == ["strict-tiny"], timeout=5)
    strict_small = place("strict-small", strict)
    settle()
    assert admitted(big, small, strict_small) == []
    run[1].leave()
    assert wait_until(lambda: admitted(big, small, strict_small) == ["big"], timeout=5)
    leave_all(strict_tiny, small, strict_small)

    # Priority before arrival; the aging bound turns best-effort strict for an old request.
    low = place("low", best_effort, slices=2)
    high = place("high", best_effort, slices=2, priority=5)
    big.leave()
    assert wait_until(lambda: admitted(low, high) == ["high"], timeout=5)
    aging = QueueSettings(aging_s=30)
    old = place("old", aging, slices=2, arrival=time.time() - 60)  # ahead of `low` by arrival, and aged
    young_tiny = place("young-tiny", aging, tpu="v6e-4")
    assert wait_until(lambda: admitted(young_tiny) == ["young-tiny"], timeout=5)  # aged: not on a slice it can't use
    assert admitted(old, low) == []
    leave_all(young_tiny, old, low, high)

    # Teams: over its quota, a team waits while another runs within its own; alone, it borrows.
    quotas = QueueSettings(quotas={"a": {"v6e-16": 16}, "b": {"v6e-16": 16}})
    a1 = place("a1", quotas, team="a")
    assert wait_until(lambda: admitted(a1) == ["a1"], timeout=5)
    a2 = place("a2", quotas, team="a")
    assert wait_until(lambda: admitted(a2) == ["a2"], timeout=5)  # nobody within quota waits: a2 borrows
    a3 = place("a3", quotas, team="a")
    b1 = place("b1", quotas, team="b")
    a2.leave()
    assert wait_until(lambda: admitted(a3, b1) == ["b1"], timeout=5)  # b within quota goes first
    assert "team a over its quota" in a3.state["reason"]
    rows = queue.snapshot()["entries"]
    assert [(r["label"], r["admitted"], r["team"]) for r in rows] == [
        ("test.a1", True, "a"), ("test.b1", True, "b"), ("test.a3", False, "a")]
    # `rayslice queue` prints the same, in order, through a short Ray job (as it would from a laptop)
    cli = str(Path(sys.executable).with_name("rayslice"))
    out = subprocess.run([cli, "queue", "--name", cluster.name], capture_output=True, text=True, timeout=180)
    table = [line.split() for line in out.stdout.splitlines() if line.strip().endswith(("a1", "b1", "a3"))]
    assert [(row[0], row[1], row[3], row[-1]) for row in table] == [
        ("1", "running", "a", "test.a1"), ("2", "running", "b", "test.b1"), ("3", "waiting", "a", "test.a3")], \
        out.stdout + out.stderr
    assert "1 x v6e-16" in out.stdout and "quotas" in out.stdout
    leave_all(a1, a3, b1)


@pytest.mark.parametrize("restart", [True, False], ids=["ray-restarts-it", "killed-and-made-anew"])
def test_a_restarted_broker_keeps_every_place(empty_queue, ray_driver, restart):
    """Killed for good (issue 38 (2)), the next launcher's `get_if_exists` used to make a broker without the
    recovery hold: the first to beat was admitted alone, onto the v6e-4 the running step still held."""
    settings = QueueSettings()
    blocker = place("blocker", settings, tpu="v6e-4")
    assert wait_until(lambda: blocker.admitted.is_set(), timeout=5)
    waiting = [place(f"w{i}", settings, tpu="v6e-4") for i in range(5)]
    settle()
    before = queue.snapshot()
    ray_driver.kill(queue.broker(), no_restart=not restart)
    if restart:
        assert wait_until(lambda: queue.snapshot()["restarts"] > before["restarts"], timeout=30)
    else:  # the last in line beats first and makes the new broker; then every place comes back, none admitted
        waiting[-1]._beat()
        assert wait_until(lambda: len(queue.snapshot()["entries"]) == 6, timeout=30)
        settle()
        assert [r["label"] for r in queue.snapshot()["entries"] if r["admitted"]] == ["test.blocker"]
    order, running = [], blocker
    while len(order) < 5:
        running.leave()
        assert wait_until(lambda: any(p.admitted.is_set() for p in waiting if p.entry.label[5:] not in order),
                          timeout=15), queue.snapshot()
        now = [p for p in waiting if p.admitted.is_set() and p.entry.label[5:] not in order]
        assert len(now) == 1, f"two admitted onto one v6e-4: {[p.entry.label for p in now]}"
        order.append(now[0].entry.label[5:])
        running = now[0]
        rows = queue.snapshot()["entries"]
        assert sum(r["admitted"] for r in rows) == 1 and len(rows) == 5 - len(order) + 1
    running.leave()
    assert order == [f"w{i}" for i in range(5)]


def test_what_a_launcher_sends_never_sets_the_policy_and_newer_fields_are_ignored(empty_queue, ray_driver):
    """Issue 38 (3): the settings a step carried replaced the cluster's; (6) a newer launcher's fields broke beats."""
    entry = entry_for(TpuSliceRequest(tpu="v6e-4"), id=f"test-hostile-{time.time_ns()}", label="test.hostile",
                      team="greedy")
    hostile = {"policy": "strict", "aging_s": 1, "quotas": {"greedy": {"v6e-4": 10**6}}}
    operator = QueueSettings(quotas={"greedy": {"v6e-4": 0}})
    operator_sets(operator)
    b = queue.broker()
    try:
        state = ray_driver.get(b.heartbeat.remote(entry.to_json(), hostile, beat_s=0.5, from_the_future=1), timeout=10)
        assert queue.snapshot()["settings"] == operator.model_dump()
        assert "admitted" in state
    finally:
        ray_driver.get(b.leave.remote(entry.id), timeout=10)


LAUNCHER = textwrap.dedent("""
    import sys, time, ray
    from rayslice.cluster import queue
    from rayslice.core.accelerators import TpuSliceRequest
    from rayslice.core.queue import entry_for
    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    entry = entry_for(TpuSliceRequest(tpu="v6e-4"), id=sys.argv[1], label="test.killed")
    queue.Place(entry, log=lambda m: None).join()
    print("queued", flush=True)
    time.sleep(600)
""")


def test_a_launcher_killed_while_waiting_loses_its_place_within_5_s(empty_queue, cluster):
    blocker = place("blocker", QueueSettings(), tpu="v6e-4")
    assert wait_until(lambda: blocker.admitted.is_set(), timeout=5)
    later = place("later", QueueSettings(), tpu="v6e-4", arrival=time.time() + 30)  # behind the killed one
    env = {**os.environ, **cluster.ray_env(), "RAY_ADDRESS": cluster.gcs_address}
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, "test-killed"], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "queued"
        assert wait_until(lambda: later.state.get("rank") == 2, timeout=5), later.state
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert wait_until(lambda: later.state.get("rank") == 1, timeout=10), later.state
        assert time.monotonic() - killed <= 5
    finally:
        proc.kill()
        proc.wait()
        leave_all(blocker, later)


def returns_none():
    return None


def test_a_stopped_waiting_step_leaves_the_queue_at_once(empty_queue, cluster):
    """`ray job stop` (what a killed Airflow task does) on a step that waits in the queue: its place goes at once."""
    import asyncio

    from rayslice.client.jobs_client import AsyncRayJobsClient
    from rayslice.client.submission import submit_step
    from rayslice.core.step import Owner, StepSpec

    blocker = place("blocker", QueueSettings(), tpu="v6e-4")
    assert wait_until(lambda: blocker.admitted.is_set(), timeout=5)
    sid = f"test-stopped-{time.time_ns()}"
    spec = StepSpec.for_function(returns_none, request=TpuSliceRequest(tpu="v6e-4"), capacity_timeout=120,
                                 owner=Owner(submission_id=sid, dag_id="dag", task_id="stopped"))

    async def submit_then_stop():
        async with AsyncRayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
            await submit_step(client, spec, emit=lambda line: None)
            try:
                assert await asyncio.to_thread(wait_until, lambda: any(
                    r["label"] == "dag.stopped" for r in queue.snapshot()["entries"]), 60)
            finally:
                await client.stop(sid)

    try:
        asyncio.run(submit_then_stop())
        stopped = time.monotonic()
        assert wait_until(lambda: all(r["label"] != "dag.stopped" for r in queue.snapshot()["entries"]), timeout=10)
        assert time.monotonic() - stopped < 2, "the stopped step's place outlived its launcher"
    finally:
        blocker.leave()


def node_of_this_process():
    import ray

    return ray.get_runtime_context().get_node_id()


def test_tpu_chips_run_on_the_slice_type_the_queue_counted_them_against(empty_queue, ray_driver):
    """Issue 38 (1): TPU chips had no node selector, so Ray put them on whatever slice was free."""
    from rayslice.cluster import run_step
    from rayslice.core.accelerators import AcceleratorRequest
    from rayslice.core.step import Owner, StepSpec

    spec = StepSpec.for_function(node_of_this_process, request=AcceleratorRequest(resource="TPU", count=4),
                                 capacity_timeout=120, owner=Owner(submission_id=f"test-chips-{time.time_ns()}"))
    place = queue.place_for(spec)
    assert (place.entry.kind, place.entry.what) == ("v6e-4", "4 TPU chips of a v6e-4")  # the smallest that holds 4
    node = run_step(spec)
    labels = next(n["Labels"] for n in ray_driver.nodes() if n["NodeID"] == node)
    assert labels["ray.io/tpu-pod-type"] == "v6e-4", labels
