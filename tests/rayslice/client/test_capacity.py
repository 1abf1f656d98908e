"""`rayslice.client.capacity` and `.usage` against the real local cluster: real Ray jobs hold slices and GPU shares.

Assertions look for this test's own holders (a fresh run id), so other steps on a shared
development cluster (RAYSLICE_TEST_CLUSTER) don't break them; only the idle checks wait for
the whole cluster to drain.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import uuid
from pathlib import Path

import httpx
import pytest
from rich.console import Console
from typer.testing import CliRunner

from rayslice.cli import app
from rayslice.client import capacity, jobs_client, usage
from rayslice.client.jobs_client import AsyncRayJobsClient
from rayslice.client.submission import submit_step
from rayslice.cluster.phases import parse_phases
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.exceptions import RayAuthError, RayUnreachableError
from rayslice.core.goodput import HELD, Account, step_account
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
            assert s.since is not None and s.held_s is not None and 0 <= s.held_s < 400  # held since when
            assert snap.taken_at.timestamp() - s.since.timestamp() == pytest.approx(s.held_s, abs=1)
        assert not any(ours(s.holder) for s in snap.slices if s.pod_type == "v6e-4")  # pinned by pod type

        [gpu] = snap.gpu_nodes
        mine = [sh for sh in gpu.shares if ours(sh.holder)]
        assert sorted((sh.holder.task_id, sh.amount, sh.state) for sh in mine) == [
            ("gpu0", 0.25, "running"), ("gpu1", 0.25, "running")]
        assert gpu.used >= 0.5 and gpu.free == pytest.approx(gpu.total - gpu.used)
        assert all(sh.since is not None and sh.held_s is not None for sh in mine)

        waits = [p for p in snap.pending if ours(p.holder)]
        assert all(p.request == "v6e-16" and p.kind == "queue" for p in waits)  # waiting in the admission queue
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
        assert wait_until(lambda: _ended(url, token, ids), timeout=120, interval=1), "our jobs did not end"
        _check_usage(url, token, dict(zip(requests, ids, strict=True)))
    finally:
        asyncio.run(_stop(url, token, ids))


def _ended(url: str, token: str | None, ids: list[str]) -> bool:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    jobs = {j["submission_id"]: j for j in httpx.get(f"{url}/api/jobs/", headers=headers, timeout=30).json()}
    return all(jobs[sid]["status"] in ("SUCCEEDED", "FAILED", "STOPPED") for sid in ids)


def _check_usage(url: str, token: str | None, ids: dict[str, str]) -> None:
    """The timeline's bars and accelerator-hours for the steps above, checked against Ray's own actor records."""
    found = usage.usage(url, token=token, hours=1)
    bars = {b.task_id: b for b in found.bars if b.submission_id in ids.values()}
    assert set(bars) == set(ids), [b.model_dump() for b in found.bars]
    nodes = capacity.snapshot(url, token=token)
    [gpu_node] = nodes.gpu_nodes
    for task, bar in bars.items():
        assert (bar.dag_id, bar.submission_id, bar.job_status, bar.end is not None) == (
            DAG, ids[task], "SUCCEEDED", True), bar
        if task.startswith("tpu"):
            assert (bar.kind, bar.amount, bar.request) == ("tpu", 16, "v6e-16") and bar.lane in ("v6e-16-a", "v6e-16-b")
        else:
            assert (bar.kind, bar.amount, bar.lane) == ("gpu", 0.25, gpu_node.node_id), bar
    assert bars["tpu2"].waited_s > max(bars["tpu0"].waited_s, bars["tpu1"].waited_s)  # it waited for a slice
    assert [lane.key for lane in found.lanes] == ["v6e-16-a", "v6e-16-b", "v6e-4-a", gpu_node.node_id]

    # The arithmetic, from the raw actor records and the step's hold (its goodput record: reserved to released):
    # amount x the hold of every host process, summed; and the bill is the chip-time the step held (issue 49).
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    actors = httpx.get(f"{url}/logical/actors", params={"nocache": "1"}, headers=headers,
                       timeout=30).json()["data"]["actors"].values()
    for task, sid in ids.items():
        mine = [a for a in actors if (a.get("name") or "").startswith(f"rayslice:{sid}/")]
        assert len(mine) == (4 if task.startswith("tpu") else 1), mine
        figures = Account.from_json(found.goodput[sid])
        [(reserved, released, _)] = figures.held
        starts = [min(a["startTime"] / 1000, reserved) for a in mine]
        ends = [max(a["endTime"] / 1000, released) for a in mine]
        expected = sum((end - start) * next(iter(v for k, v in a["requiredResources"].items() if k in ("TPU", "GPU")))
                       for a, start, end in zip(mine, starts, ends, strict=True)) / 3600
        assert bars[task].hours == pytest.approx(expected, abs=1e-6) and expected > 0
        assert bars[task].hours * 3600 == pytest.approx(figures.held_chip_s, rel=0.02)
        assert bars[task].start.timestamp() == pytest.approx(min(starts), abs=1e-3)
        assert bars[task].end.timestamp() == pytest.approx(max(ends), abs=1e-3)
    by_dag, by_task = usage.totals(found.bars)
    [dag_row] = [r for r in by_dag if r.dag_id == DAG]
    tpu_hours = sum(b.hours for t, b in bars.items() if t.startswith("tpu"))
    assert dag_row.tpu_chip_hours >= round(tpu_hours, 6) - 1e-6 and dag_row.steps >= 5
    rows = {r.task_id: r for r in by_task if r.dag_id == DAG}  # other runs of this DAG may add to them
    for task, bar in bars.items():
        billed = rows[task].tpu_chip_hours if task.startswith("tpu") else rows[task].gpu_hours
        assert billed >= bar.hours - 1e-6 and bar.hours > 0

    # Goodput, read back from each ended job's log: the figures are its timeline's, and they add up.
    for sid in ids.values():
        figures = Account.from_json(found.goodput[sid])
        log = httpx.get(f"{url}/api/jobs/{sid}/logs", headers=headers, timeout=30).json()["logs"]
        # The figures come from the job's goodput record, the timeline from its phase lines: each rounds its times
        # (to the ms) on its own, and a step whose body is a few ms (tpu2's, once the flag exists) has a goodput that
        # rounding moves by more than 0.1% of itself. So: equal up to a few ms of each phase, on every chip.
        timeline = step_account(parse_phases(log))
        assert figures.held_chip_s == pytest.approx(timeline.held_chip_s, abs=0.005 * 16) and figures.held_chip_s > 0
        assert figures.goodput == pytest.approx(timeline.goodput, abs=1e-3) and 0 < figures.goodput < 1
        assert sum(figures.chip_s[c] for c in HELD) == pytest.approx(figures.held_chip_s, rel=0.01)
        assert "[rayslice] goodput: " in log and figures.attempts == 1
    assert Account.from_json(found.goodput[ids["tpu2"]]).seconds["waiting"] > max(
        Account.from_json(found.goodput[ids[t]]).seconds["waiting"] for t in ("tpu0", "tpu1"))
    rows = {r.task_id: r for r in usage.totals(usage.select(found, dag_id=DAG), found.goodput)[1]}
    assert rows["tpu0"].measured >= 1 and rows["tpu0"].goodput is not None and rows["tpu0"].chip_h["productive"] > 0
    # The command: the same rows, filtered by DAG and task.
    out = CliRunner().invoke(app, ["usage", "--address", url, *(["--token", token] if token else []), "--hours", "1",
                                   "--dag", DAG, "--task", "gpu0", "--json"])
    assert out.exit_code == 0, out.output
    [row] = json.loads(out.output)["rows"]
    assert (row["task_id"], row["gpu_hours"] > 0, row["goodput"] is not None) == ("gpu0", True, True)

    # A window that starts half-way through a bar bills only the part inside it.
    bar = bars["tpu0"]
    start, end = bar.start.timestamp(), bar.end.timestamp()
    middle = (start + end) / 2
    bodies = [httpx.get(f"{url}{path}", params=params, headers=headers, timeout=30).json()
              for path, params in (usage._NODES, usage._ACTORS, ("/api/jobs/", {}))]
    clipped = usage.parse(*bodies, now=end, hours=(end - middle) / 3600)
    [half] = [b for b in clipped.bars if b.submission_id == bar.submission_id]
    in_window = [a for a in actors if (a.get("name") or "").startswith(f"rayslice:{bar.submission_id}/")]
    expected = sum(16 / 4 * max(0.0, a["endTime"] / 1000 - max(a["startTime"] / 1000, middle)) for a in in_window)
    assert half.hours == pytest.approx(expected / 3600, abs=1e-6) and half.hours < bar.hours


def test_unreachable_dashboard_says_what_to_check(monkeypatch):
    monkeypatch.setattr(jobs_client._BaseJobsClient, "_delay", lambda self, attempt: 0.0)  # the message, not the pauses
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


def test_a_step_waiting_in_the_admission_queue_is_pending_demand():
    """Its launcher holds `rayslice:<sid>/queued` (one tiny CPU bundle) while it waits: shown waiting, in the queue."""
    job = {"type": "SUBMISSION", "job_id": "02000000", "submission_id": "sid", "status": "RUNNING",
           "start_time": 1_000_000, "metadata": {"dag_id": "d", "run_id": "r", "task_id": "t", "request": "v6e-16 x2"}}
    marker = {"placement_group_id": "pg1", "name": "rayslice:sid/queued", "state": "CREATED",
              "creator_job_id": "02000000", "bundles": [{"unit_resources": {"CPU": 0.001}, "node_id": "n"}]}
    snap = capacity._parse(_state([]), _state([marker]), _state([]), [job], now=1_040.0)
    assert [(p.kind, p.request, p.holder.task_id, p.waiting_s) for p in snap.pending] == [
        ("queue", "v6e-16 x2", "t", 40)]
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(capacity.render(snap))
    assert "in the admission queue" in console.export_text()


def test_a_suspended_step_back_in_the_queue_shows_why_it_was_suspended():
    """Its launcher names why in its queue marker: `rayslice:<sid>/suspended: <why>/queued`."""
    job = {"type": "SUBMISSION", "job_id": "02000000", "submission_id": "sid", "status": "RUNNING",
           "start_time": 1_000_000, "metadata": {"dag_id": "d", "run_id": "r", "task_id": "train",
                                                 "request": "v6e-16 x2", "priority": "0"}}
    why = "suspended for d.eval (priority 10, waiting for 1 x v6e-16; this step's priority is 0)"
    marker = {"placement_group_id": "pg1", "name": f"rayslice:sid/suspended: {why}/queued", "state": "CREATED",
              "creator_job_id": "02000000", "bundles": [{"unit_resources": {"CPU": 0.001}, "node_id": "n"}]}
    snap = capacity._parse(_state([]), _state([marker]), _state([]), [job], now=1_040.0)
    assert [(p.kind, p.holder.task_id, p.suspended) for p in snap.pending] == [("queue", "train", why)]
    console = Console(record=True, width=300, file=io.StringIO())
    console.print(capacity.render(snap))
    assert f"suspended: {why}" in console.export_text()


def test_steps_in_the_admission_queue_are_numbered_in_line_by_priority_then_arrival():
    """Per kind of capacity, as the broker orders them; priority and team come from the job's metadata."""

    def job(n: int, request: str, start_s: float = 1_000, **meta: str) -> dict:
        return {"type": "SUBMISSION", "job_id": f"0{n}000000", "submission_id": f"s{n}", "status": "RUNNING",
                "start_time": int(start_s * 1000), "metadata": {"dag_id": "d", "run_id": "r", "task_id": f"t{n}",
                                                                "request": request, **meta}}

    def marker(n: int, created: float) -> dict:
        return {"placement_group_id": f"pg{n}", "name": f"rayslice:s{n}/queued", "state": "CREATED",
                "creator_job_id": f"0{n}000000", "bundles": [{"unit_resources": {"CPU": 0.001}, "node_id": "n"}],
                "stats": {"creation_request_received_ns": int(created * 1e9)}}

    jobs = [job(1, "v6e-16", priority="1"), job(2, "v6e-16 x2 (multislice)", priority="5", team="research"),
            job(3, "GPU x0.25", priority="1"), job(4, "v6e-4", priority="1"), job(5, "TPU x1", priority="1")]
    markers = [marker(1, 1_001), marker(2, 1_010), marker(3, 1_020), marker(4, 1_005), marker(5, 1_030)]
    snap = capacity._parse(_state([]), _state(markers), _state([]), jobs, now=1_040.0)
    line = {p.holder.task_id: (p.place, p.priority, p.team) for p in snap.pending}
    # one line per slice type, as the broker's (issue 38 (8): it was one "TPU" line)
    assert line == {"t2": (1, 5, "research"), "t1": (2, 1, None), "t4": (1, 1, None), "t5": (1, 1, None),
                    "t3": (1, 1, None)}
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(capacity.render(snap))
    assert "in the admission queue: 1st in line, priority 5, team research" in console.export_text()
    # arrival is the job's start, as the broker's: a retried or slow-to-mark step keeps its place
    jobs = [job(6, "v6e-16", start_s=1_002), job(7, "v6e-16", start_s=1_001)]
    snap = capacity._parse(_state([]), _state([marker(6, 1_003), marker(7, 1_009)]), _state([]), jobs, now=1_040.0)
    assert {p.holder.task_id: p.place for p in snap.pending} == {"t7": 1, "t6": 2}


def test_tpu_chip_steps_wait_in_the_line_of_the_slice_type_the_broker_puts_them_on():
    """Issue 38 (8): the broker lines TPU chips up with the slice type they run on (the smallest of their generation
    whose hosts hold them: `core.queue.chip_slice_type`), behind or ahead of that type's slice steps; chips no
    host holds wait in a "TPU" line of their own. The page numbered every chip step in one "TPU" line."""

    def host(slice_name: str, pod_type: str, worker: int) -> dict:
        return {"node_id": f"{slice_name}-{worker}", "state": "ALIVE", "resources_total": {"TPU": 4.0},
                "labels": {capacity.SLICE_LABEL: slice_name, capacity.POD_TYPE_LABEL: pod_type,
                           capacity.WORKER_LABEL: str(worker)}}

    def job(n: int, request: str, priority: int, start_s: float) -> dict:
        return {"type": "SUBMISSION", "job_id": f"0{n}000000", "submission_id": f"s{n}", "status": "RUNNING",
                "start_time": int(start_s * 1000), "metadata": {"dag_id": "d", "run_id": "r", "task_id": f"t{n}",
                                                                "request": request, "priority": str(priority)}}

    def marker(n: int) -> dict:
        return {"placement_group_id": f"pg{n}", "name": f"rayslice:s{n}/queued", "state": "CREATED",
                "creator_job_id": f"0{n}000000", "bundles": [{"unit_resources": {"CPU": 0.001}, "node_id": "n"}]}

    nodes = [host("small", "v6e-4", 0), *(host("big", "v6e-16", w) for w in range(4))]
    jobs = [job(1, "v6e-4", 5, 1_000), job(2, "TPU x4 (TPU-V6E)", 1, 1_001), job(3, "TPU x2", 9, 1_002),
            job(4, "v6e-16", 1, 1_003), job(5, "TPU x8", 1, 1_004), job(6, "TPU x1 (TPU-V5P)", 1, 1_005)]
    snap = capacity._parse(_state(nodes), _state([marker(n) for n in range(1, 7)]), _state([]), jobs, now=1_040.0)
    line = {p.holder.task_id: p.place for p in snap.pending}
    # v6e-4's line: t3 (2 chips, priority 9), t1 (the slice, priority 5), t2 (4 chips); v6e-16's: t4;
    # "TPU" (no host holds 8 chips; no v5p slice): t5, then t6
    assert line == {"t3": 1, "t1": 2, "t2": 3, "t4": 1, "t5": 1, "t6": 2}


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


def test_reads_share_the_jobs_clients_retries_tls_settings_and_errors(monkeypatch):
    """503s are retried, a CA bundle path works (no DeprecationWarning), a refused token is named, never shown."""
    import certifi

    monkeypatch.setattr(jobs_client._BaseJobsClient, "_delay", lambda self, attempt: 0.0)  # retried, not paused

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


def test_a_refresh_reads_only_the_jobs_it_names_and_ended_ones_once(cluster, monkeypatch):
    """No whole job list per refresh: the jobs the holders and bars name, by id; an ended job's record is kept."""
    from rayslice.client import job_records
    from rayslice.client.jobs_client import RayJobsClient

    asked: list[str] = []
    real = RayJobsClient.get_json

    def counting(self, path, params=None):
        asked.append(path)
        return real(self, path, params)

    monkeypatch.setattr(RayJobsClient, "get_json", counting)
    monkeypatch.setattr(job_records, "_by_dashboard", {})
    url, token = cluster.dashboard_url, cluster.token
    capacity.snapshot(url, token=token)
    found = usage.usage(url, token=token, hours=72)
    # The first reading may take the whole list once (more than LIST_ABOVE unknown jobs, as on a cluster
    # that has run the suite so far); every later refresh reads by id only, and never an ended job again.
    assert asked.count("/api/jobs/") <= 1, asked
    ended = {b.submission_id for b in found.bars if b.job_status in job_records.TERMINAL}
    asked.clear()
    capacity.snapshot(url, token=token)
    usage.usage(url, token=token, hours=72)
    assert "/api/jobs/" not in asked, asked
    assert not [p for p in asked if p.removeprefix("/api/jobs/") in ended], asked  # ended records are kept


def test_the_readings_are_parsed_off_the_event_loop(cluster, monkeypatch):
    """The API server's loop also serves Airflow's Execution API: decoding and parsing run in a thread."""
    import threading

    threads: dict[str, object] = {}
    for module, name in ((capacity, "_parse"), (usage, "parse")):
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            threads[_name] = threading.current_thread()
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)

    async def both():
        return await asyncio.gather(capacity.asnapshot(cluster.dashboard_url, token=cluster.token),
                                    usage.ausage(cluster.dashboard_url, token=cluster.token, hours=1))

    asyncio.run(both())
    assert set(threads) == {"_parse", "parse"} and threading.main_thread() not in threads.values(), threads
