"""One step over two real local Ray clusters (`set-a`, `set-b`, a v6e-4 each): it runs on whichever admits it
first, skips a cluster that cannot take it, resumes on the other after a drain notice (through the real Airflow,
with what the task tells of it: tests/e2e/test_cluster_set_drain.py), and never runs on two at once
(rayslice/client/cluster_set.py, rayslice/cluster/set_member.py, rayslice/core/cluster_claim.py).

Proof comes from the clusters, not the launcher's word: each cluster's Ray job records (status and log), the
step bodies' own records (which cluster's GCS they ran under), and both clusters' free TPU chips.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path

import pytest

from rayslice.client.cluster_set import Member, ran_by, run_on_set, spec_for_set, stood_by
from rayslice.client.jobs_client import AsyncRayJobsClient, RayJobsClient
from rayslice.client.submission import run_step_job
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.exceptions import InvalidRequestError, UnsatisfiableRequestError
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster
from tests.cluster_pair import NAMES, Pair
from tests.conftest import wait_until


def where_am_i(seconds: float = 0.0, record: str = "", flag: str = "") -> dict:
    """The step body: which cluster's GCS it runs under, and, with `record`, its start and end in a file."""
    import ray

    started = time.time()
    gcs = ray.get_runtime_context().gcs_address
    if flag:
        Path(flag).with_suffix(".started").write_text(gcs)
        while not Path(flag).exists():
            time.sleep(0.1)
    time.sleep(seconds)
    if record:
        with open(record, "a") as out:
            out.write(json.dumps({"gcs": gcs, "start": started, "end": time.time()}) + "\n")
    return {"gcs": gcs}


def step(name: str, pair: Pair, fn=where_am_i, request: str = "v6e-4", **kwargs) -> StepSpec:
    owner = Owner(dag_id="sets", run_id="r1", task_id=name, try_number=1)
    return StepSpec.for_function(fn, request=TpuSliceRequest(tpu=request), kwargs=kwargs, owner=owner,
                                 launcher="installed", capacity_timeout=120,
                                 checkpoint_root=f"file://{pair.shared}")


def on_set(pair: Pair, spec: StepSpec, *names: str, lines: list[str] | None = None, told: list[str] | None = None):
    """Run `spec` over the clusters `names`; `told`: each cluster `run_on_set` said runs the step, in order."""
    if spec.cluster_set is None:
        spec = spec_for_set(spec, "tpus", names, shared_root=True)
    out = lines if lines is not None else []

    async def go():
        members = pair.members(*names)
        try:
            return await run_on_set(spec, members, emit=lambda line: (out.append(line), print(line)),
                                    on_cluster=told.append if told is not None else None)
        finally:
            for member in members:
                await member.client.aclose()

    return asyncio.run(go()), spec


def test_a_step_naming_both_runs_on_the_one_that_is_free_while_the_other_is_held(cluster_pair, tmp_path):
    a, b = (cluster_pair.records[n] for n in NAMES)
    flag = tmp_path / "hold"
    holding = step("holder", cluster_pair, flag=str(flag))

    async def hold():
        return await run_step_job(a.dashboard_url, holding, token=a.token, emit=lambda line: None)

    loop = asyncio.new_event_loop()
    import threading

    held: dict = {}
    holder = threading.Thread(target=lambda: held.update(result=loop.run_until_complete(hold())))
    holder.start()
    try:
        assert wait_until(lambda: flag.with_suffix(".started").exists(), timeout=120), "the holder never started on a"
        lines: list[str] = []
        told: list[str] = []
        result, spec = on_set(cluster_pair, step("mover", cluster_pair), *NAMES, lines=lines, told=told)
    finally:
        flag.write_text("go")
        holder.join(120)
    assert held["result"][0]["gcs"] == a.gcs_address
    assert result[0]["gcs"] == b.gcs_address, "\n".join(lines)
    log = "\n".join(lines)
    assert "the step ran on cluster set-b" in log and "cluster set-a stood by" in log, log
    # The clusters' own records: b's job ran it; a's ended without running it.
    status_b, log_b = cluster_pair.jobs("set-b", spec.owner.submission_id)
    status_a, log_a = cluster_pair.jobs("set-a", spec.owner.submission_id)
    assert status_b == "SUCCEEDED" and "the step runs on cluster set-b" in log_b
    assert status_a == "FAILED" and "RanElsewhereError" in log_a and "running on" not in log_a
    # Who ran it, as the task's XCom and "Ray job" link get it: told once, the cluster that ran it; and from the two
    # clusters' own job records (a link made before any cluster claimed it), set-a's job read as standing by.
    assert told == ["set-b"]
    records = {}
    for name in NAMES:
        with RayJobsClient(cluster_pair.records[name].dashboard_url, token=cluster_pair.records[name].token) as c:
            records[name] = c.get(spec.owner.submission_id)
    assert stood_by(records["set-a"]) and ran_by(records) == "set-b", records["set-a"].message


def test_an_unreachable_cluster_is_skipped_with_why_and_the_step_runs_on_the_next(cluster_pair):
    dead = f"http://127.0.0.1:{local_cluster.free_port()}"  # a head that is down: nothing listens there
    lines: list[str] = []
    spec = spec_for_set(step("skipper", cluster_pair), "tpus", ("set-dead", NAMES[0]), shared_root=True)

    async def go():
        members = [Member("set-dead", AsyncRayJobsClient(dead, retries=0, timeout=3)),
                   *cluster_pair.members(NAMES[0])]
        try:
            return await run_on_set(spec, members, emit=lines.append)
        finally:
            for member in members:
                await member.client.aclose()

    result = asyncio.run(go())
    assert result[0]["gcs"] == cluster_pair.records[NAMES[0]].gcs_address
    log = "\n".join(lines)
    assert "cluster set-dead skipped: unreachable" in log and dead.split("//")[1] in log, log


def test_a_request_no_cluster_of_the_set_has_fails_naming_each_refusal(cluster_pair):
    lines: list[str] = []
    with pytest.raises(UnsatisfiableRequestError, match="no cluster of set 'tpus' ran the step"):
        on_set(cluster_pair, step("too-big", cluster_pair, request="v6e-16"), *NAMES, lines=lines)
    log = "\n".join(lines)
    assert "cluster set-a skipped: it refused the request" in log and "cluster set-b skipped" in log, log


def test_a_root_on_one_machine_is_refused_before_anything_is_submitted(cluster_pair):
    with pytest.raises(InvalidRequestError, match="one machine's disk"):
        spec_for_set(step("local-root", cluster_pair), "tpus", NAMES)


def counting_fit(steps: int, seconds_per_step: float) -> dict:
    """A training loop that checkpoints every step and heeds a notice: saves, then raises StepSuspended."""
    import ray

    from rayslice import StepSuspended, get_step_context

    ctx = get_step_context()
    folder = Path(ctx.checkpoint_dir.removeprefix("file://"))
    folder.mkdir(parents=True, exist_ok=True)
    saved = folder / "step.json"
    start = json.loads(saved.read_text())["step"] if saved.exists() else 0
    gcs = ray.get_runtime_context().gcs_address
    with open(folder / "bodies.jsonl", "a") as out:
        out.write(json.dumps({"gcs": gcs, "from": start, "at": time.time()}) + "\n")
    for i in range(start, steps):
        time.sleep(seconds_per_step)
        with open(folder / "done.jsonl", "a") as out:
            out.write(json.dumps({"step": i, "gcs": gcs}) + "\n")
        saved.write_text(json.dumps({"step": i + 1}))
        if ctx.preempted:
            raise StepSuspended(f"saved step {i + 1}")
    return {"gcs": gcs, "resumed_from": start}


def test_many_steps_on_both_never_run_on_two_clusters_at_once_and_leave_every_chip_free(cluster_pair, tmp_path):
    record = tmp_path / "bodies.jsonl"
    count = int(os.environ.get("RAYSLICE_SET_STEPS", "8"))
    rng = random.Random(7)
    specs = [spec_for_set(step(f"many-{i}", cluster_pair, seconds=rng.uniform(0.2, 1.5), record=str(record)),
                          "tpus", NAMES, shared_root=True) for i in range(count)]

    async def go():
        members = cluster_pair.members(*NAMES)
        try:
            return await asyncio.gather(*(run_on_set(spec, members, emit=lambda line: None) for spec in specs))
        finally:
            for member in members:
                await member.client.aclose()

    results = asyncio.run(go())
    gcs = {cluster_pair.records[n].gcs_address: n for n in NAMES}
    assert all(result[0]["gcs"] in gcs for result in results)
    # From both clusters' job records: per step, exactly one job ran the body; the other stood by.
    for spec in specs:
        records = {name: cluster_pair.jobs(name, spec.owner.submission_id) for name in NAMES}
        ran = [name for name, (_, log) in records.items() if "the step runs on cluster" in log]
        statuses = {name: status for name, (status, _) in records.items()}
        assert len(ran) == 1 and statuses[ran[0]] == "SUCCEEDED", (spec.owner.task_id, ran, statuses)
    # From the bodies' own records: one body per step, and no two bodies on one slice at once.
    bodies = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(bodies) == count
    for name in gcs:
        mine = sorted((b["start"], b["end"]) for b in bodies if b["gcs"] == name)
        assert all(end <= nxt_start for (_, end), (nxt_start, _) in zip(mine, mine[1:], strict=False)), mine
    assert wait_until(lambda: all(cluster_pair.free_chips(n) == 4 for n in NAMES), timeout=60)


def test_a_holder_whose_driver_is_killed_fails_the_step_and_the_standby_is_stopped(cluster_pair, tmp_path):
    """The holder dies without writing its end: the submitter sees its job fail while it holds the claim, takes
    that as the step's outcome, and stops the other cluster's standby (which would otherwise wait for ever).
    Whichever cluster claimed the step (a, unless b's job got there 0.25 s sooner) is the one whose driver dies."""
    import psutil

    flag = tmp_path / "never"
    spec = spec_for_set(step("killed-holder", cluster_pair, flag=str(flag)), "tpus", NAMES, shared_root=True)
    sid = spec.owner.submission_id
    by_gcs = {cluster_pair.records[n].gcs_address: n for n in NAMES}
    killed: dict = {}

    def kill_the_holders_driver():
        started = flag.with_suffix(".started")  # the body writes its cluster there: wait for the whole text
        assert wait_until(lambda: started.exists() and started.read_text() in by_gcs, timeout=120)
        holder = cluster_pair.records[killed.setdefault("name", by_gcs[started.read_text()])]
        for proc in psutil.process_iter(["cmdline", "cwd"]):
            cmdline, cwd = " ".join(proc.info["cmdline"] or []), proc.info["cwd"] or ""
            if "rayslice.cluster spec.json" in cmdline and cwd.startswith(holder.temp_dir):
                proc.kill()
                killed.setdefault("pids", []).append(proc.pid)
        if not killed.get("pids"):
            flag.write_text("go")  # no driver found: let the step end rather than wait for ever

    import threading

    killer = threading.Thread(target=kill_the_holders_driver)
    killer.start()
    lines: list[str] = []
    told: list[str] = []
    try:
        with pytest.raises(Exception) as info:
            on_set(cluster_pair, spec, *NAMES, lines=lines, told=told)
    finally:
        killer.join(150)
    holder = killed["name"]
    standby = next(n for n in NAMES if n != holder)
    assert killed.get("pids"), f"no driver of the step ran on {holder}"
    log = "\n".join(lines)
    assert f"the step ran on cluster {holder}, and failed there" in log, (info.value, log)
    assert told == [holder], told  # the task's link and XCom name the cluster it failed on
    assert wait_until(lambda: cluster_pair.jobs(standby, sid)[0] in ("STOPPED", "FAILED"), timeout=60), \
        f"the standby on {standby} was left waiting"
    assert wait_until(lambda: not cluster_pair.held_by(holder, sid), timeout=120), cluster_pair.held_by(holder, sid)


def test_a_set_spends_one_preemption_budget_whichever_clusters_suspend_the_step(cluster_pair):
    """`preemption_retries=1` over two clusters: drained on the first, the step resumes on the other (the one
    retry); drained there too, it fails as preempted instead of resuming a second time on a fresh budget."""
    spec = step("drained-twice", cluster_pair, fn=counting_fit, steps=60, seconds_per_step=0.5)
    spec = spec_for_set(spec.model_copy(update={"preemption_retries": 1}), "tpus", NAMES, shared_root=True)
    sid = spec.owner.submission_id
    folder = cluster_pair.shared / "sets" / "r1" / "drained-twice"
    by_gcs = {cluster_pair.records[n].gcs_address: n for n in NAMES}
    drained: list[str] = []

    def bodies() -> list[dict]:
        path = folder / "bodies.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def drain_whichever_runs_it(nth: int) -> None:
        """Once the `nth` body has saved a step past where it began, drain its cluster (30 s ahead)."""
        assert wait_until(lambda: len(bodies()) >= nth and (folder / "step.json").exists()
                          and json.loads((folder / "step.json").read_text())["step"] > bodies()[nth - 1]["from"],
                          timeout=180, interval=0.2), bodies()
        record = cluster_pair.records[by_gcs[bodies()[nth - 1]["gcs"]]]
        drained.append(record.name)
        local_cluster.preempt(record, next(n.slice_name for n in record.nodes if n.slice_name), 30, kill=False)

    import threading

    drainer = threading.Thread(target=lambda: (drain_whichever_runs_it(1), drain_whichever_runs_it(2)))
    drainer.start()
    lines: list[str] = []
    try:
        with pytest.raises(Exception) as info:
            on_set(cluster_pair, spec, *NAMES, lines=lines)
    finally:
        drainer.join(240)
        for name in drained:
            cluster_pair.replace_tpu_node(name)  # a drained node is done: the next tests get a fresh one
    log = "\n".join(lines)
    ran_on = [by_gcs[body["gcs"]] for body in bodies()]
    assert ran_on == drained and sorted(ran_on) == sorted(NAMES), (bodies(), drained, log)  # one body each, no third
    assert "1 preemption retries used so far on the set" in log, log
    assert "preemption_retries=1 are used up" in log, (info.value, log)
    for name in NAMES:
        assert wait_until(lambda n=name: not cluster_pair.held_by(n, sid), timeout=60), cluster_pair.held_by(name, sid)
