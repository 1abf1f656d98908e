"""Which cluster of a set runs a step, as the submitter tells it (rayslice/client/cluster_set.py): from the claims
folder while it runs (`on_cluster`, for the task's XCom and its "Ray job" link), and from the members' job records
(`ran_by`, for a link made before any cluster claimed it). No cluster: a real local claims folder, job records as
the Jobs API gives them. The same on two real clusters: tests/rayslice/client/test_cluster_set.py."""

from __future__ import annotations

import asyncio

from rayslice.client import cluster_set
from rayslice.client.cluster_set import ran_by, spec_for_set, stood_by
from rayslice.client.job_details import JobDetails
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.cluster_claim import Claims
from rayslice.core.context import checkpoint_dir_for
from rayslice.core.step import Owner, StepSpec
from tests.set_dashboards import STOOD_BY


def job(status: str, message: str = "") -> JobDetails:
    return JobDetails(status=status, submission_id="s", message=message)


def test_the_job_that_succeeded_or_the_one_left_that_did_not_stand_by_ran_the_step():
    assert stood_by(job("FAILED", STOOD_BY)) and not stood_by(job("FAILED", "exit code 1: ValueError"))
    assert not stood_by(job("RUNNING"))
    assert ran_by({"a": job("FAILED", STOOD_BY), "b": job("SUCCEEDED")}) == "b"
    assert ran_by({"a": job("FAILED", "StepFailedError: boom"), "b": job("FAILED", STOOD_BY)}) == "a"
    assert ran_by({"a": None, "b": job("RUNNING")}) == "b"  # a was skipped at submission: no job there
    # Both still waiting (or one holds, one stands by, and the records cannot tell): not known from records.
    assert ran_by({"a": job("RUNNING"), "b": job("PENDING")}) is None
    assert ran_by({"a": None, "b": None}) is None
    # A member that could not be asked may be the one that runs it: only a success tells then.
    assert ran_by({"b": job("RUNNING")}, unknown=["a"]) is None
    assert ran_by({"b": job("SUCCEEDED")}, unknown=["a"]) == "b"


def test_the_submitter_tells_each_cluster_that_claims_the_step_once(tmp_path, monkeypatch):
    """Claimed by a, released after a suspension, claimed by b, done on b: told a, then b (no repeats, nobody in the
    gap between the release and the next claim, and a claim still being written names nobody)."""
    monkeypatch.setattr(cluster_set, "WATCH_S", 0.02)
    spec = StepSpec.for_function(len, request=TpuSliceRequest(tpu="v6e-4"), checkpoint_root=f"file://{tmp_path}",
                                 owner=Owner(dag_id="d", run_id="r", task_id="t", try_number=1))
    spec = spec_for_set(spec, "tpus", ("a", "b"), shared_root=True)
    folder = checkpoint_dir_for(spec.checkpoint_root, spec.owner)
    on = {name: Claims(folder, member=name, submission_id=spec.owner.submission_id) for name in "ab"}
    told: list[str] = []

    async def watch():
        def tell(name):
            if name and (not told or told[-1] != name):
                told.append(name)

        watcher = asyncio.ensure_future(cluster_set._watch_holder(spec, tell))
        try:
            async def until(what):
                for _ in range(500):
                    if what():
                        return True
                    await asyncio.sleep(0.01)
                return False

            await asyncio.sleep(0.1)
            assert told == []  # nobody claimed it yet
            root = on["a"].fs, on["a"]._root
            root[0].makedirs(root[1], exist_ok=True)
            with root[0].open(f"{root[1]}/claim-0.json", "wb"):
                pass  # created, not yet written: a reader sees "?"
            await asyncio.sleep(0.1)
            assert told == []
            root[0].rm(f"{root[1]}/claim-0.json")
            assert on["a"].take().holder["cluster"] == "a"
            assert await until(lambda: told == ["a"]), told
            on["a"].release(0, "a drain notice")
            await asyncio.sleep(0.1)
            assert told == ["a"]  # between two generations: the last holder stands
            assert on["b"].take().holder["cluster"] == "b"
            assert await until(lambda: told == ["a", "b"]), told
            on["b"].finish("succeeded")
            await asyncio.sleep(0.1)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    asyncio.run(watch())
    assert told == ["a", "b"]


def test_holder_of_reads_done_before_the_claim_in_play(tmp_path):
    claims = Claims(f"file://{tmp_path}", member="a", submission_id="s")
    assert cluster_set.holder_of(claims.state()) is None
    claims.take()
    assert cluster_set.holder_of(claims.state()) == "a"
    claims.release(0, "moved")
    assert cluster_set.holder_of(claims.state()) is None
    b = Claims(f"file://{tmp_path}", member="b", submission_id="s")
    b.take()
    b.finish("failed: StepFailedError")
    assert cluster_set.holder_of(b.state()) == "b"
    assert cluster_set.holder_of(None) is None

