"""The claims that keep a step on several clusters running on one at a time (rayslice/core/cluster_claim.py)."""

from __future__ import annotations

import multiprocessing
import os

import pytest
from pydantic import ValidationError

from rayslice.core.cluster_claim import Claims, ClusterSet, check_shared_root, end_other_chains
from rayslice.core.exceptions import InvalidRequestError


def claims(folder, member: str, sid: str = "sid") -> Claims:
    return Claims(f"file://{folder}", member=member, submission_id=sid)


def test_the_first_take_holds_and_the_second_cluster_sees_who(tmp_path):
    a, b = claims(tmp_path, "a"), claims(tmp_path, "b")
    assert a.take().held_by("a", "sid")
    seen = b.take()
    assert seen.holder["cluster"] == "a" and not seen.held_by("b", "sid") and seen.generation == 0
    assert a.take().held_by("a", "sid"), "taking again keeps a claim already this job's"


def test_a_release_frees_the_next_generation_for_any_cluster_and_done_ends_the_chain(tmp_path):
    a, b = claims(tmp_path, "a"), claims(tmp_path, "b")
    a.take()
    a.release(0, "drained")
    state = b.take()
    assert state.generation == 1 and state.held_by("b", "sid")
    assert a.take().holder["cluster"] == "b", "a released generation 0: it cannot take 1 from b"
    b.finish("succeeded")
    after = a.take()
    assert after.done == {**after.done, "cluster": "b", "outcome": "succeeded"}
    assert after.holder["cluster"] == "b", "a finished chain is taken by nobody"


def test_the_retries_a_step_used_pass_down_the_chain_to_whichever_cluster_holds_it_next(tmp_path):
    """One preemption budget for the whole set: each release says how many were used, the next holder reads it."""
    a, b = claims(tmp_path, "a"), claims(tmp_path, "b")
    assert a.retries_before(a.take().generation) == 0
    a.release(0, "drained", retries_used=1)
    state = b.take()
    assert state.generation == 1 and b.retries_before(1) == 1
    b.release(1, "a priority step", retries_used=2)
    assert a.retries_before(a.take().generation) == 2


def test_a_claim_is_never_seen_half_written_and_a_write_that_fails_leaves_no_claim(tmp_path, monkeypatch):
    """On a local or mounted folder the claim appears whole (a hard link of the writer's own file): no reader
    sees an empty claim that would hold every other cluster standing by, and a writer whose write fails
    leaves no claim at all."""
    import builtins

    a, b = claims(tmp_path, "a"), claims(tmp_path, "b")
    real_open = builtins.open

    def full_disk(path, mode="r", *args, **kwargs):
        if "claim-0" in str(path) and "w" in mode:
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_disk)
    with pytest.raises(OSError, match="No space"):
        a.take()
    monkeypatch.setattr(builtins, "open", real_open)
    assert a.state().holder is None, "a failed write left a claim"
    assert b.take().held_by("b", "sid"), "the generation is free for the next cluster"
    folder = tmp_path / ".rayslice-claims" / "sid"
    assert sorted(p.name for p in folder.iterdir()) == ["claim-0.json"], "the writers' own files are gone"


def test_a_retry_ends_every_earlier_chain_of_the_step_so_their_queued_jobs_never_claim(tmp_path):
    first, second = claims(tmp_path, "a", sid="try1"), claims(tmp_path, "b", sid="try2")
    first.take()  # try 1 held the step (its job may still wait in an unreachable cluster's queue)
    claims(tmp_path, "c", sid="try0").finish("failed")  # an older chain that ended by itself is left as it was
    assert end_other_chains(f"file://{tmp_path}", "try2", "superseded by try 2") == ["try1"]
    assert first.state().done["superseded_by"] == "try2"
    assert claims(tmp_path, "c", sid="try1").take().done is not None, "an ended chain is claimed by nobody"
    assert second.take().held_by("b", "try2"), "the retry's own chain is untouched"
    assert end_other_chains(f"file://{tmp_path / 'none'}", "x", "y") == []


def test_a_retry_does_not_start_beside_an_earlier_try_that_holds_the_step_on_a_cluster_it_cannot_reach(tmp_path):
    """try 1 holds the step on cluster a, which the retry cannot reach (a partition): its body may still run there,
    so the retry refuses, in words, and ends no chain; a holder on a cluster it reached (and stopped) is ended."""
    claims(tmp_path, "a", sid="try1").take()
    with pytest.raises(InvalidRequestError, match="holds the step on cluster a, which cannot be reached"):
        end_other_chains(f"file://{tmp_path}", "try2", "superseded by try 2", unreachable={"a"})
    assert claims(tmp_path, "a", sid="try1").state().done is None
    assert end_other_chains(f"file://{tmp_path}", "try2", "superseded by try 2", unreachable={"b"}) == ["try1"]


def test_each_submission_is_a_chain_of_its_own(tmp_path):
    """A retry, or a run created again under the same run id (same checkpoint folder), is a new submission id:
    an earlier chain's claim or `done` never stops it."""
    first = claims(tmp_path, "a", sid="try1")
    first.take()
    first.finish("succeeded")
    assert claims(tmp_path, "b", sid="try2").take().held_by("b", "try2")


def _race(folder: str, member: str, start, results) -> None:
    start.wait()
    state = claims(folder, member).take()
    results.put((member, state.held_by(member, "sid")))


@pytest.mark.parametrize("round_", range(5))
def test_of_many_clusters_taking_at_once_exactly_one_holds(tmp_path, round_):
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Event(), ctx.Queue()
    members = [f"c{i}" for i in range(6)]
    procs = [ctx.Process(target=_race, args=(str(tmp_path), m, start, results)) for m in members]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(30)
    won = [m for m, held in (results.get(timeout=5) for _ in members) if held]
    assert len(won) == 1, won
    assert claims(tmp_path, "x").state().holder["cluster"] == won[0]


def test_a_filesystem_without_exclusive_create_is_refused_in_words(tmp_path, monkeypatch):
    """A store other than a local or mounted folder creates a claim with fsspec's exclusive create (`xb`)."""
    c = Claims(f"memory://{tmp_path.name}", member="a", submission_id="sid")
    real_open = c.fs.open

    def no_exclusive(path, mode="rb", **kw):
        if "x" in mode:
            raise NotImplementedError("mode 'xb' not supported")
        return real_open(path, mode, **kw)

    monkeypatch.setattr(c.fs, "open", no_exclusive)
    with pytest.raises(InvalidRequestError, match="cannot create a file only if it is absent"):
        c.take()


def test_a_set_names_each_cluster_once_and_knows_its_rank():
    assert ClusterSet(name="tpus", members=("a", "b"), member="b").rank == 1
    with pytest.raises(ValidationError, match="each cluster once"):
        ClusterSet(name="tpus", members=("a", "a"))
    with pytest.raises(ValidationError):
        ClusterSet(name="tpus", members=("a",))
    with pytest.raises(ValidationError, match="1-64 letters"):
        ClusterSet(name="tpus", members=("a", "b/../c"))


@pytest.mark.parametrize("root", [None, "", "/mnt/ckpt", "file:///tmp/ckpt", "local:///x", "memory://x",
                                  "simplecache::file:///tmp/x", "filecache::file:///var/ckpt"])
def test_a_root_only_one_machine_reads_is_refused_for_a_set(root):
    with pytest.raises(InvalidRequestError, match="checkpoint root|every cluster"):
        check_shared_root(root, "task 'train'")


def test_a_shared_store_is_accepted():
    check_shared_root("gs://bucket/ckpt", "task 'train'")
    check_shared_root("s3://bucket/ckpt", "task 'train'")


def test_claims_live_in_the_steps_folder_under_the_submission(tmp_path):
    c = claims(tmp_path, "a", sid="rayslice-d-t-1")
    c.take()
    assert os.path.exists(tmp_path / ".rayslice-claims" / "rayslice-d-t-1" / "claim-0.json")


def test_the_listing_is_read_past_the_filesystems_cache(tmp_path, monkeypatch):
    """gcsfs caches listings forever by default: a waiting cluster must still see another's release."""
    c = claims(tmp_path, "a")
    asked = []
    real_ls = c.fs.ls
    monkeypatch.setattr(c.fs, "ls", lambda path, **kw: asked.append(kw) or real_ls(path, **kw))
    c.state()
    assert asked and asked[0].get("refresh") is True
