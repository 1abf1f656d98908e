"""Reservation under contention, on the real test cluster (two v6e-16, one v6e-4, 3 GPUs).

All-or-nothing across slices, one deadline, the order in which waiting requests are served
(a stream of small requests no longer starves a large one: the admission queue), slow releases that must not
hide the step's outcome, and requests no node could ever hold.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rayslice.cluster import reservation
from rayslice.cluster.reservation import reserve_slices
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.exceptions import CapacityTimeoutError, StepFailedError, UnsatisfiableRequestError
from rayslice.core.step import Owner, StepSpec
from tests.conftest import TOTAL_TPU_CHIPS, wait_until
from tests.rayslice.cluster.test_launcher import assert_all_released, run

pytestmark = pytest.mark.timeout(600)


def count_devices_for_5_s():
    import time

    import jax

    time.sleep(5)
    return jax.device_count()


class HeadSampler:
    """Every 100 ms, which placement groups hold TPU slice heads, and how many heads each holds.

    Ray places a group's bundles all at once or not at all, so a request whose heads are
    spread over several groups (one per slice) can hold part of what it asked for.
    """

    def __init__(self) -> None:
        self.samples: list[dict[str, int]] = []  # group name (or id) -> heads held
        self.waiting: list[set[str]] = []  # names of head groups still pending
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HeadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        from ray.util.placement_group import placement_group_table

        while not self._stop.wait(0.1):
            held, waiting = {}, set()
            for group in placement_group_table().values():
                if group["name"].endswith("/queued") and group["state"] == "CREATED":
                    waiting.add(group["name"])  # waiting in the admission queue
                    continue
                heads = sum(1 for b in group["bundles"].values() if any(k.endswith("-head") for k in b))
                if not heads:
                    continue
                if group["state"] == "CREATED":
                    held[group["name"] or group["placement_group_id"]] = heads
                elif group["state"] == "PENDING":
                    waiting.add(group["name"])
            self.samples.append(held)
            self.waiting.append(waiting)


def test_two_multislice_requests_at_once_take_turns_never_holding_part(cluster, ray_driver):
    """Two 2-slice requests on a cluster of two slices: one runs, then the other; neither ever holds one head."""
    from rayslice.client.submission import run_step_job

    request = TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True)
    sids = [f"test-contend-{name}-{time.time_ns()}" for name in "ab"]
    specs = [
        StepSpec.for_function(count_devices_for_5_s, request=request, capacity_timeout=150,
                              owner=Owner(submission_id=sid))
        for sid in sids
    ]

    async def both():
        return await asyncio.gather(*(run_step_job(cluster.dashboard_url, spec, token=cluster.token,
                                                   emit=lambda line: None) for spec in specs))

    with HeadSampler() as sampler:
        results = asyncio.run(both())
    assert results == [[32] * 8, [32] * 8]
    assert len(sampler.samples) > 100
    partial = [sample for sample in sampler.samples if any(heads != 2 for heads in sample.values())]
    assert partial == [], f"a request held some but not all of its slice heads: {partial[:3]}"
    assert max(len(sample) for sample in sampler.samples) == 1, "both requests held slices at once"
    # They really contended: one waited (in the admission queue) while the other held both slices.
    assert any(len(held) == 1 and waiting for held, waiting in zip(sampler.samples, sampler.waiting, strict=True))
    assert_all_released(ray_driver)


def test_one_deadline_bounds_the_whole_reservation(ray_driver):
    """capacity_timeout bounds the wait for all slices together, not once per slice."""
    busy = reserve_slices(TpuSliceRequest(tpu="v6e-16"), timeout=30, name=f"rayslice:test-busy-{time.time_ns()}")
    try:
        started = time.monotonic()
        with pytest.raises(CapacityTimeoutError, match="nothing was left reserved"):
            reserve_slices(TpuSliceRequest(tpu="v6e-16", num_slices=2), timeout=4,
                           name=f"rayslice:test-{time.time_ns()}")
        waited = time.monotonic() - started
        assert waited < 4 + 2, f"waited {waited:.1f} s for a 4 s capacity_timeout"
        assert ray_driver.available_resources().get("TPU-v6e-16-head", 0) == 1  # the free slice stayed free
    finally:
        busy.release()
    assert_all_released(ray_driver)


#: The stream test's clock: each request holds its slices this long, the streams ask for `STREAM_S`, the 2-slice
#: request asks `BIG_ASKS_S` in (the four streams' first requests then hold both slices and wait for them).
HOLD_S, STREAM_S, BIG_ASKS_S = 3.0, 20.0, 5.0


def test_a_stream_of_one_slice_steps_no_longer_starves_a_two_slice_step(ray_driver):
    """Four streams of one-slice 3 s holds, back to back for 20 s, keep both v6e-16 busy with more
    waiting; 5 s in, a 2-slice multislice request asks for both. Without a queue it waited until the
    streams stopped; with it, it starts in its turn: after the one-slice requests that asked before
    it, before every one that asked after it, within 30 s of asking.

    Each request takes its place in the queue as the launcher does (`place_for` its step, then
    `reserve_slices`) and holds its slices for 3 s: the order is what is tested, so no step program
    runs in between (tests/rayslice/cluster/test_queue.py runs the queue under real steps)."""
    from rayslice.cluster import queue as admission

    started = time.time()
    done: list[tuple[int, int, float, float, float]] = []  # stream, n, asked, started, released
    big: list[tuple[float, float]] = []
    errors: list[BaseException] = []

    def hold(request) -> float:
        spec = StepSpec(callable="tests.hold:three_seconds", request=request, capacity_timeout=300,
                        owner=Owner(submission_id=f"test-queue-{time.time_ns()}"))
        held = reserve_slices(request, timeout=300, name=f"rayslice:{spec.owner.submission_id}",
                              place=admission.place_for(spec))
        at = time.time()
        time.sleep(HOLD_S)
        held.release()
        return at

    def stream(k):
        try:
            time.sleep(k * HOLD_S / 4)  # staggered
            n = 0
            while time.time() - started < STREAM_S:
                asked = time.time()
                at = hold(TpuSliceRequest(tpu="v6e-16"))
                done.append((k, n, asked, at, time.time()))
                n += 1
        except BaseException as exc:
            errors.append(exc)

    def two_slices():
        try:
            time.sleep(BIG_ASKS_S)
            asked = time.time()
            big.append((asked, hold(TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True))))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(4)] + [threading.Thread(target=two_slices)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    (asked, big_started), = big
    passed = [d[:2] for d in done if d[2] > asked + 1 and d[3] < big_started]
    assert passed == [], f"one-slice requests that asked after the 2-slice one started before it: {passed}"
    ahead = [d for d in done if d[2] < asked and d[4] > asked]  # holding or waiting when it asked
    assert len(ahead) <= 4
    assert big_started - asked <= 30, f"the 2-slice request started {big_started - asked:.0f} s after asking"
    assert any(d[2] > big_started for d in done), "the streams stopped before it started: nothing was tested"
    assert len(done) >= 8 and {d[0] for d in done} == {0, 1, 2, 3}
    assert_all_released(ray_driver)


def returns_four():
    return 4


def raises_value_error():
    raise ValueError("the step's own error")


@pytest.mark.parametrize("slow_gcs_step", ["succeeds", "fails"])
def test_a_slow_release_never_hides_the_steps_outcome(ray_driver, monkeypatch, capsys, slow_gcs_step):
    """Ray frees the groups only 3 s after removal is asked, past release's wait: the outcome stands, logged."""
    real_remove = reservation.remove_placement_group

    def slow_remove(group):
        threading.Timer(3.0, real_remove, args=(group,)).start()

    monkeypatch.setattr(reservation, "remove_placement_group", slow_remove)
    monkeypatch.setattr(reservation, "RELEASE_TIMEOUT_S", 0.5)
    if slow_gcs_step == "succeeds":
        assert run(TpuSliceRequest(tpu="v6e-4"), returns_four) == [4]
    else:
        with pytest.raises(StepFailedError, match="the step's own error"):
            run(TpuSliceRequest(tpu="v6e-4"), raises_value_error)
    out = capsys.readouterr().out
    assert "but Ray has not freed rayslice:test-" in out and "/heads" in out and "/hosts" in out
    assert wait_until(lambda: ray_driver.available_resources().get("TPU") == TOTAL_TPU_CHIPS, timeout=10)
    assert_all_released(ray_driver)


@pytest.mark.parametrize(
    "request_",
    [
        AcceleratorRequest(resource="NPU", count=0.5),
        AcceleratorRequest(resource="GPU", count=0.25, accelerator_type="H100"),
        AcceleratorRequest(resource="GPU", count=4),
    ],
    ids=["npu-on-a-cluster-without-npus", "h100-on-a-cluster-without-h100s", "more-gpus-than-any-node"],
)
def test_an_accelerator_request_no_node_could_hold_fails_at_once(ray_driver, request_):
    started = time.monotonic()
    with pytest.raises(UnsatisfiableRequestError, match="can never be scheduled on this cluster") as info:
        run(request_, returns_four)
    assert time.monotonic() - started < 30  # not the 600 s capacity_timeout
    assert str(request_) in str(info.value) and "Accelerators here: GPU x3" in str(info.value)
    assert wait_until(lambda: ray_driver.available_resources().get("GPU") == 3.0)


def which_slice():
    import rayslice

    return rayslice.get_step_context().slice_name


def test_a_slice_with_a_busy_worker_is_passed_over_for_a_wholly_free_one(cluster, ray_driver):
    """A plain Ray actor asking `TPU: 4` sits on worker 1 of one v6e-16: a v6e-16 step gets the other at once.

    Ray picks a slice head at random (it took the busy slice 5 times in 12 before the fix), so each
    busy slice is tried with several reservations and one whole step.
    """
    from rayslice.cluster import run_step
    from rayslice.cluster.reservation import POD_TYPE_LABEL, SLICE_NAME_LABEL, WORKER_ID_LABEL

    slices = sorted({n["Labels"][SLICE_NAME_LABEL] for n in ray_driver.nodes()
                     if n["Alive"] and n.get("Labels", {}).get(POD_TYPE_LABEL) == "v6e-16"})
    for busy in slices:  # whichever slice Ray's scheduler would take first, it is busy once
        holder = ray_driver.remote(num_cpus=0, resources={"TPU": 4}, label_selector={
            SLICE_NAME_LABEL: busy, WORKER_ID_LABEL: "1"})(type("Holder", (), {"ping": lambda self: 1})).remote()
        try:
            assert ray_driver.get(holder.ping.remote(), timeout=120) == 1
            request = TpuSliceRequest(tpu="v6e-16")
            assert reservation.trapped_slices(request, ray_driver.nodes(), set()) == {busy}
            for _ in range(4):
                held = reserve_slices(request, timeout=10, name=f"rayslice:test-busy-worker-{time.time_ns()}")
                try:
                    assert {host.slice_name for host in held.hosts} == set(slices) - {busy}
                finally:
                    assert held.release() == []
            spec = StepSpec.for_function(which_slice, request=TpuSliceRequest(tpu="v6e-16"), capacity_timeout=60,
                                         owner=Owner(submission_id=f"test-busy-worker-{time.time_ns()}"))
            assert set(run_step(spec)) == set(slices) - {busy}
        finally:
            ray_driver.kill(holder)
    assert_all_released(ray_driver)  # heads groups made anew while waiting are gone too


def test_a_slice_whose_busy_worker_frees_up_is_taken_while_the_other_stays_held(cluster, ray_driver):
    """The trapped set is looked at again while the heads wait: once the worker frees, its slice is taken."""
    from ray.util.placement_group import placement_group_table

    from rayslice.cluster.reservation import POD_TYPE_LABEL, SLICE_NAME_LABEL, WORKER_ID_LABEL

    request = TpuSliceRequest(tpu="v6e-16")
    held = reserve_slices(request, timeout=30, name=f"rayslice:test-other-{time.time_ns()}")
    [other] = {host.slice_name for host in held.hosts}
    [trapped] = {n["Labels"][SLICE_NAME_LABEL] for n in ray_driver.nodes() if n["Alive"]
                 and n.get("Labels", {}).get(POD_TYPE_LABEL) == "v6e-16"} - {other}
    holder = ray_driver.remote(num_cpus=0, resources={"TPU": 4}, label_selector={
        SLICE_NAME_LABEL: trapped, WORKER_ID_LABEL: "1"})(type("Holder", (), {"ping": lambda self: 1})).remote()
    got: dict = {}
    try:
        assert ray_driver.get(holder.ping.remote(), timeout=120) == 1
        waiter = threading.Thread(target=lambda: got.setdefault("reservation", reserve_slices(
            request, timeout=60, name=f"rayslice:test-freed-{time.time_ns()}")))
        waiter.start()
        assert wait_until(lambda: any(g["name"].endswith("/heads") and g["state"] == "PENDING"
                                      for g in placement_group_table().values()), timeout=30)
        assert "reservation" not in got  # neither slice is free as a whole
        ray_driver.kill(holder)
        waiter.join(timeout=60)
        assert not waiter.is_alive() and "reservation" in got, "the freed slice was never taken"
        assert {host.slice_name for host in got["reservation"].hosts} == {trapped}
    finally:
        ray_driver.kill(holder)
        if "reservation" in got:
            assert got["reservation"].release() == []
        assert held.release() == []
    assert_all_released(ray_driver)


def test_a_retry_avoids_the_slice_of_a_node_just_lost_while_the_gcs_still_shows_it_alive(ray_driver):
    from rayslice.cluster.reservation import POD_TYPE_LABEL, SLICE_NAME_LABEL, WORKER_ID_LABEL

    hosts = {(n["Labels"][SLICE_NAME_LABEL], n["Labels"][WORKER_ID_LABEL]): n["NodeID"] for n in ray_driver.nodes()
             if n["Alive"] and n.get("Labels", {}).get(POD_TYPE_LABEL) == "v6e-16"}
    for lost_slice in sorted({name for name, _ in hosts}):
        lost = frozenset({hosts[(lost_slice, "2")]})
        held = reserve_slices(TpuSliceRequest(tpu="v6e-16"), timeout=60, name=f"test-lost-{time.time_ns()}",
                              lost_nodes=lost)
        try:
            assert {host.slice_name for host in held.hosts} != {lost_slice}
        finally:
            assert held.release() == []


class _SuspendedWhileWaiting:
    """A step's queue place, admitted at once, that the broker tells to suspend after `after` looks at Ray's
    placement; records whether the reservation gave the place up (its caller keeps or leaves it)."""

    def __init__(self, after: int) -> None:
        self.after, self.looks, self.left, self.suspend = after, 0, False, None

    def wait(self, timeout):
        return 0.0

    def leave(self):
        self.left = True


@pytest.mark.parametrize("waiting_for", ["heads", "hosts"])
def test_a_victim_still_waiting_for_ray_to_place_its_slices_gives_them_back_at_once(monkeypatch, waiting_for):
    """Review 2026-12-06 (4): a victim admitted but still waiting for Ray to place its heads (or its hosts,
    behind a busy worker) heard the suspension only once placed, so it held what it had until its whole
    capacity_timeout. It looks at its place's word while it waits, and gives back what it holds at once."""
    from rayslice.core.exceptions import SuspendedError

    place = _SuspendedWhileWaiting(after=3)
    made, removed = [], []

    def ready(group, deadline):
        place.looks += 1
        assert place.looks <= place.after + 1, "it waited on for Ray after it was told to suspend"
        if place.looks == place.after:
            place.suspend = ("suspended for d.urgent (priority 10)", 30.0)
        return waiting_for == "hosts" and group == "heads"  # the heads placed at once, or never

    def group(bundles, strategy, name, bundle_label_selector):
        made.append(name.rsplit("/", 1)[1])
        return name.rsplit("/", 1)[1]

    monkeypatch.setattr(reservation.ray, "nodes", lambda: [])
    monkeypatch.setattr(reservation, "check_satisfiable", lambda request, nodes, lost=frozenset(): set())
    monkeypatch.setattr(reservation, "trapped_slices", lambda request, nodes, broken: set())
    monkeypatch.setattr(reservation, "_slices", lambda request, nodes, lost: (set(), 1))
    monkeypatch.setattr(reservation, "_slice_names", lambda heads, nodes: ["v6e-16-a"])
    monkeypatch.setattr(reservation, "placement_group", group)
    monkeypatch.setattr(reservation, "remove_placement_group", removed.append)
    monkeypatch.setattr(reservation, "_removed", lambda group: True)
    monkeypatch.setattr(reservation, "wait_ready", ready)
    with pytest.raises(SuspendedError, match="d.urgent"):
        reserve_slices(TpuSliceRequest(tpu="v6e-16"), timeout=600, name="rayslice:v", place=place)
    assert sorted(removed) == sorted(made) and made  # nothing held
    assert not place.left  # the launcher requeues it (it resumes in its place) or leaves it
