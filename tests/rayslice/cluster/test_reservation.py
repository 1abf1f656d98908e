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
    # They really contended: one waited (its heads group pending) while the other held both slices.
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


def one_slice_step(stream, n):
    import time

    time.sleep(6)
    return [stream, n]


def two_slice_step():
    import time

    return time.time()


def test_a_stream_of_one_slice_steps_no_longer_starves_a_two_slice_step(cluster, ray_driver):
    """Four streams of one-slice 6 s steps, back to back for 80 s, keep both v6e-16 busy; 10 s in, a
    2-slice multislice step asks for both. The admission queue serves it within 30 s (without one it
    waited until the streams stopped); every step returns its own result."""
    from rayslice.client.submission import run_step_job

    one = TpuSliceRequest(tpu="v6e-16")
    started = time.time()
    results: dict[str, list] = {"stream": [], "big": []}

    async def step(fn, request, kwargs, timeout):
        spec = StepSpec.for_function(fn, request=request, kwargs=kwargs, capacity_timeout=timeout,
                                     owner=Owner(submission_id=f"test-queue-{fn.__name__}-{time.time_ns()}"))
        return await run_step_job(cluster.dashboard_url, spec, token=cluster.token, emit=lambda line: None)

    async def stream(k):
        await asyncio.sleep(k * 1.5)  # staggered
        n = 0
        while time.time() - started < 80:
            assert await step(one_slice_step, one, {"stream": k, "n": n}, 300) == [[k, n]] * 4
            results["stream"].append((k, n))
            n += 1

    async def big():
        await asyncio.sleep(10)
        asked = time.time()
        starts = await step(two_slice_step, TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True), {}, 120)
        assert len(starts) == 8
        results["big"].append((asked, min(starts), time.time() - started))

    async def everything():
        await asyncio.gather(big(), *(stream(k) for k in range(4)))

    asyncio.run(everything())
    (asked, first_host, done_at), = results["big"]
    assert first_host - asked <= 30, f"the 2-slice step started {first_host - asked:.0f} s after asking"
    assert done_at < 80, "it ran only once the streams had stopped"
    assert len(results["stream"]) >= 8 and {k for k, _ in results["stream"]} == {0, 1, 2, 3}
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
    """A plain Ray actor asking `TPU: 4` sits on worker 1 of one v6e-16: a v6e-16 step gets the other at once."""
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
            assert reservation.free_slices(request, ray_driver.nodes(), set()) == set(slices) - {busy}
            spec = StepSpec.for_function(which_slice, request=TpuSliceRequest(tpu="v6e-16"), capacity_timeout=60,
                                         owner=Owner(submission_id=f"test-busy-worker-{time.time_ns()}"))
            assert set(run_step(spec)) == set(slices) - {busy}
        finally:
            ray_driver.kill(holder)


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
