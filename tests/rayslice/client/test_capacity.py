"""`rayslice.client.capacity` against the real local cluster: real Ray jobs hold slices and GPU shares.

Assertions look for this test's own holders (a fresh run id), so other steps on a shared
development cluster (RAYSLICE_TEST_CLUSTER) don't break them; only the idle checks wait for
the whole cluster to drain.
"""

from __future__ import annotations

import asyncio
import io
import os
import uuid
from pathlib import Path

import pytest
from rich.console import Console

from rayslice.client import capacity
from rayslice.client.jobs_client import AsyncRayJobsClient
from rayslice.client.submission import submit_step
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.exceptions import RayAuthError, RayUnreachableError
from rayslice.core.step import Owner, StepSpec
from rayslice.local.local_cluster import free_port
from tests.conftest import wait_until
from tests.http_fake import JsonHttpFake, Request

DAG = "capacity_test"


def hold_until(flag: str, limit: float = 240.0) -> int:
    """The step: keep its capacity until the test drops the flag file (or `limit` passes)."""
    import os
    import time

    deadline = time.monotonic() + limit
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.2)
    return 1


def idle_snapshot(cluster) -> capacity.Snapshot | None:
    snap = capacity.snapshot(cluster.dashboard_url, token=cluster.token)
    quiet = all(s.state == "free" for s in snap.slices) and all(n.used == 0 for n in snap.gpu_nodes)
    return snap if quiet and not snap.pending else None


def test_idle_cluster_is_all_free(cluster):
    snap = wait_until(lambda: idle_snapshot(cluster), timeout=120, interval=1)
    assert snap, "the cluster never drained; other steps still hold capacity"
    assert [(s.name, s.pod_type, s.topology, len(s.hosts), s.chips) for s in snap.slices] == [
        ("v6e-16-a", "v6e-16", "4x4", 4, 16), ("v6e-16-b", "v6e-16", "4x4", 4, 16), ("v6e-4-a", "v6e-4", "2x2", 1, 4)]
    assert [h.worker_id for h in snap.slices[0].hosts] == [0, 1, 2, 3]
    assert all(h.state == "free" and h.holder is None and h.chips == 4 for s in snap.slices for h in s.hosts)
    assert [(n.total, n.used, n.free, n.shares) for n in snap.gpu_nodes] == [(3, 0, 3, [])]
    # The CLI prints it, and --json round-trips.
    console = Console(record=True, width=140, file=io.StringIO())
    console.print(capacity.render(snap))
    text = console.export_text()
    assert "v6e-16-b" in text and "No pending demand" in text
    assert capacity.Snapshot.model_validate(snap.model_dump(mode="json")).slices == snap.slices


async def _submit(url: str, token: str | None, specs: list[StepSpec]) -> list[str]:
    async with AsyncRayJobsClient(url, token=token) as client:
        return [await submit_step(client, spec) for spec in specs]


async def _stop(url: str, token: str | None, ids: list[str]) -> None:
    async with AsyncRayJobsClient(url, token=token) as client:
        for sid in ids:
            await client.stop(sid)


@pytest.mark.timeout(600)
def test_busy_slices_shared_gpu_and_pending_demand(cluster, tmp_path: Path):
    """Two v6e-16 steps hold both slices, a third waits, two 0.25 GPU steps share one GPU."""
    run_id = f"capacity-{uuid.uuid4().hex[:8]}"
    flag = tmp_path / "release"
    requests = {"tpu0": TpuSliceRequest(tpu="v6e-16"), "tpu1": TpuSliceRequest(tpu="v6e-16"),
                "tpu2": TpuSliceRequest(tpu="v6e-16"),
                "gpu0": AcceleratorRequest(resource="GPU", count=0.25),
                "gpu1": AcceleratorRequest(resource="GPU", count=0.25)}
    specs = [StepSpec.for_function(hold_until, request=request, kwargs={"flag": str(flag)}, capacity_timeout=400,
                                   owner=Owner(dag_id=DAG, run_id=run_id, task_id=task_id))
             for task_id, request in requests.items()]
    url, token = cluster.dashboard_url, cluster.token
    ids = asyncio.run(_submit(url, token, specs))

    def ours(holder: capacity.Holder | None) -> bool:
        return holder is not None and holder.dag_id == DAG and holder.run_id == run_id

    def settled() -> capacity.Snapshot | None:
        snap = capacity.snapshot(url, token=token)
        running = [s for s in snap.slices if s.state == "running" and ours(s.holder)
                   and all(h.state == "running" for h in s.hosts)]
        waiting = [p for p in snap.pending if ours(p.holder)]
        shares = [sh for n in snap.gpu_nodes for sh in n.shares if ours(sh.holder)]
        held = {s.holder.task_id for s in running} | {p.holder.task_id for p in waiting}
        return snap if running and waiting and held == {"tpu0", "tpu1", "tpu2"} and len(shares) == 2 else None

    try:
        snap = wait_until(settled, timeout=400, interval=2)
        assert snap, f"capacity never showed our steps: {capacity.snapshot(url, token=token).model_dump_json()}"
        # Ours and running on every host; on a shared cluster another of ours may be part-way in.
        running = [s for s in snap.slices if ours(s.holder) and all(h.state == "running" for h in s.hosts)]
        for s in running:
            assert s.pod_type == "v6e-16" and s.chips == 16
            assert {h.holder.submission_id for h in s.hosts} == {s.holder.submission_id} <= set(ids)
            assert s.holder.request == "v6e-16" and s.holder.job_status == "RUNNING" and s.holder.map_index == -1
            assert s.holder.label == f"{DAG}/{s.holder.task_id} ({run_id})"
        assert not any(ours(s.holder) for s in snap.slices if s.pod_type == "v6e-4")  # pinned by pod type

        [gpu] = snap.gpu_nodes
        mine = [sh for sh in gpu.shares if ours(sh.holder)]
        assert sorted((sh.holder.task_id, sh.amount, sh.state) for sh in mine) == [
            ("gpu0", 0.25, "running"), ("gpu1", 0.25, "running")]
        assert gpu.used >= 0.5 and gpu.free == pytest.approx(gpu.total - gpu.used)

        waits = [p for p in snap.pending if ours(p.holder)]
        assert all(p.request == "v6e-16" and p.kind == "placement_group" for p in waits)
        assert all(p.waiting_s is not None and 0 <= p.waiting_s < 400 and p.since for p in waits)
        if len(running) == 2:  # a fresh cluster: both slices ours, the third request waits
            assert len(waits) == 1 and waits[0].holder.task_id not in {s.holder.task_id for s in running}

        console = Console(record=True, width=1000, file=io.StringIO())  # no folding: the assertions read whole labels
        console.print(capacity.render(snap))
        text = console.export_text()
        assert f"{DAG}/tpu0 ({run_id})" in text and "Pending demand" in text and "x0.25" in text
    finally:
        flag.touch()

    def released() -> bool:
        snap = capacity.snapshot(url, token=token)
        return not (any(ours(s.holder) for s in snap.slices) or any(ours(p.holder) for p in snap.pending)
                    or any(ours(sh.holder) for n in snap.gpu_nodes for sh in n.shares))

    try:
        assert wait_until(released, timeout=180, interval=1), "our steps still hold capacity after release"
        if not os.environ.get("RAYSLICE_TEST_CLUSTER"):  # our own cluster: everything is free again
            assert wait_until(lambda: idle_snapshot(cluster), timeout=60, interval=1)
    finally:
        asyncio.run(_stop(url, token, ids))


def test_unreachable_dashboard_says_what_to_check():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RayUnreachableError, match="check the `ray` connection's host"):
        capacity.snapshot(url, timeout=2)
    with pytest.raises(RayUnreachableError, match=url) as raised:
        asyncio.run(capacity.asnapshot(url, token="secret-token", timeout=2))
    assert "secret-token" not in str(raised.value)


def test_async_and_sync_agree(cluster):
    sync = capacity.snapshot(cluster.dashboard_url, token=cluster.token)
    async_ = asyncio.run(capacity.asnapshot(cluster.dashboard_url, token=cluster.token))
    assert [(s.name, len(s.hosts)) for s in sync.slices] == [(s.name, len(s.hosts)) for s in async_.slices]
    assert [n.total for n in sync.gpu_nodes] == [n.total for n in async_.gpu_nodes]


def _state(rows: list[dict]) -> dict:
    """A state API body, as `/api/v0/<kind>?detail=1` wraps it."""
    return {"result": True, "data": {"result": {"total": len(rows), "num_after_truncation": len(rows),
                                                "num_filtered": len(rows), "result": rows}}}


def test_a_gpu_actor_that_fits_is_starting_not_waiting():
    """PENDING_CREATION covers both "no capacity" and "worker still starting"; free GPU share tells them apart."""
    gpu = {"node_id": "g", "state": "ALIVE", "resources_total": {"GPU": 1.0, "CPU": 4.0}, "labels": {}}
    job = {"type": "SUBMISSION", "job_id": "02000000", "submission_id": "sid", "status": "RUNNING",
           "start_time": 1_000_000, "metadata": {"dag_id": "d", "run_id": "r", "task_id": "t", "request": "GPU x0.5"}}

    def actor(name: str, state: str, node: str | None, gpus: float) -> dict:
        return {"name": f"rayslice:{name}/GPU", "state": state, "node_id": node, "job_id": "02000000",
                "placement_group_id": None, "required_resources": {"GPU": gpus}}

    def parse(*actors: dict) -> capacity.Snapshot:
        return capacity._parse(_state([gpu]), _state([]), _state(list(actors)), [job], now=1_060.0)

    starting = parse(actor("sid", "PENDING_CREATION", None, 0.5))
    assert [(p.kind, p.request, p.starting, p.waiting_s) for p in starting.pending] == [("actor", "GPU x0.5", True, 60)]
    full = parse(actor("other", "ALIVE", "g", 0.75), actor("sid", "PENDING_CREATION", None, 0.5))
    assert [(p.starting, p.holder.task_id) for p in full.pending] == [(False, "t")]
    assert [(n.used, n.free) for n in full.gpu_nodes] == [(0.75, 0.25)]


class StateApiFake(JsonHttpFake):
    """A dashboard with an empty cluster behind a token, whose first answers are 503 (a restarting proxy)."""

    def __init__(self, token: str, unavailable: int = 0) -> None:
        self.token, self.unavailable = token, unavailable
        super().__init__()

    def answer(self, request: Request) -> tuple[int, object]:
        if self.unavailable:
            self.unavailable -= 1
            return 503, {"error": "restarting"}
        if request.authorization != f"Bearer {self.token}":
            return 401, {"error": f"bad token {request.authorization}"}
        return 200, [] if request.path == "/api/jobs/" else _state([])


def test_reads_share_the_jobs_clients_retries_tls_settings_and_errors():
    """503s are retried, a CA bundle path works (no DeprecationWarning), a refused token is named, never shown."""
    import certifi

    with StateApiFake("right-token", unavailable=2) as fake:
        snap = capacity.snapshot(fake.url, token="right-token", verify=certifi.where())
        assert (snap.slices, snap.gpu_nodes, snap.pending, fake.unavailable) == ([], [], [], 0)
        fake.unavailable = 1
        assert asyncio.run(capacity.asnapshot(fake.url, token="right-token", verify=certifi.where())).slices == []
        for read in (lambda: capacity.snapshot(fake.url, token="wrong-secret"),
                     lambda: asyncio.run(capacity.asnapshot(fake.url, token="wrong-secret"))):
            with pytest.raises(RayAuthError, match="password") as info:
                read()
            assert "wrong-secret" not in str(info.value)
