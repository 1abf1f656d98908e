"""Claims: defects found by trying to break the review's fixes (issue 53): the whole create, a retry's end of the
earlier chains. Cluster-free: a real local folder."""

from __future__ import annotations

import builtins

import pytest

from rayslice.core.cluster_claim import Claims, end_other_chains
from rayslice.core.exceptions import InvalidRequestError


def claims(folder, member: str, sid: str = "sid") -> Claims:
    return Claims(f"file://{folder}", member=member, submission_id=sid)


def test_a_claim_whose_write_fails_halfway_leaves_no_file_of_its_writer(tmp_path, monkeypatch):
    real_open = builtins.open

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def write(self, data):
            raise OSError(28, "No space left on device")

        def __exit__(self, *exc):
            self.f.close()

    def opened(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FullDisk(f) if str(path).endswith(".tmp") and "w" in mode else f

    monkeypatch.setattr(builtins, "open", opened)
    with pytest.raises(OSError, match="No space"):
        claims(tmp_path, "a").take()
    monkeypatch.setattr(builtins, "open", real_open)
    assert claims(tmp_path, "b").take().held_by("b", "sid")
    folder = tmp_path / ".rayslice-claims" / "sid"
    assert sorted(p.name for p in folder.iterdir()) == ["claim-0.json"], "a writer's own file was left behind"


def test_a_claim_made_as_the_retry_ends_the_earlier_chain_on_a_cluster_it_cannot_reach_stops_the_retry(
        tmp_path, monkeypatch):
    # try 1's job waits in cluster a's queue (a cannot be reached by the retry); nobody holds the step yet.
    claims(tmp_path, "c", sid="try1").fs.makedirs(claims(tmp_path, "c", sid="try1")._root, exist_ok=True)
    real_write = Claims._write
    admitted = []

    def a_admits_it_meanwhile(self, name, data):  # a's queue admits try 1's job as the retry ends its chain
        if name == "done.json" and self.submission_id == "try1" and not admitted:
            admitted.append(claims(tmp_path, "a", sid="try1").take().held_by("a", "try1"))
        return real_write(self, name, data)

    monkeypatch.setattr(Claims, "_write", a_admits_it_meanwhile)
    try:
        end_other_chains(f"file://{tmp_path}", "try2", "superseded by try 2", unreachable={"a"})
    except InvalidRequestError:
        return  # the retry refused to start beside it
    assert admitted == [True]
    pytest.fail("try 1 holds the step on cluster a (claimed before its `done`), and the retry goes on beside it")


def test_a_retry_after_a_kill_that_could_not_reach_the_holder_does_not_start_beside_it(tmp_path):
    from rayslice.core.cluster_claim import end_chain

    # try 1 runs the step on cluster a; the task is killed while a is cut off: on_kill stops what it reaches and
    # ends try 1's chain, but a's job (holding generation 0) runs on.
    assert claims(tmp_path, "a", sid="try1").take().held_by("a", "try1")
    assert end_chain(f"file://{tmp_path}", "try1", "stopped: its Airflow task was killed", killed=True)
    # The task is cleared: try 2 still cannot reach a.
    with pytest.raises(InvalidRequestError, match="holds the step on cluster a"):
        end_other_chains(f"file://{tmp_path}", "try2", "superseded by try 2", unreachable={"a"})


def test_a_retry_beside_an_earlier_chain_that_ended_by_itself_on_a_cluster_it_cannot_reach_goes_on(tmp_path):
    """Held up: the holder wrote the chain's end itself (it ran to its end): an unreachable member is no reason
    to refuse."""
    first = claims(tmp_path, "a", sid="try1")
    assert first.take().held_by("a", "try1")
    first.finish("failed")
    assert end_other_chains(f"file://{tmp_path}", "try2", "superseded by try 2", unreachable={"a"}) == []
