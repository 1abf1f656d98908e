"""A launcher's part in a step over several clusters (rayslice/cluster/set_member.py), cluster-free: its claims
live in a folder on this machine, as they do for the local clusters."""

from __future__ import annotations

from rayslice.cluster.set_member import SetMember
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.cluster_claim import ClusterSet
from rayslice.core.step import Owner, StepSpec


def member(tmp_path, name: str, retries: int = 2) -> SetMember:
    spec = StepSpec(command=["true"], request=TpuSliceRequest(tpu="v6e-4"), preemption_retries=retries,
                    owner=Owner(dag_id="d", run_id="r", task_id="t", submission_id="sid"),
                    cluster_set=ClusterSet(name="tpus", members=("a", "b"), member=name))
    return SetMember(spec, f"file://{tmp_path}", log=lambda line: None)


def test_the_retries_used_elsewhere_leave_this_cluster_fewer(tmp_path):
    """One budget for the set: over n clusters a step must not resume up to n x `preemption_retries` times."""
    a, b = member(tmp_path, "a"), member(tmp_path, "b")
    assert a.claim() and (a.retries_used, a.resumptions_left) == (0, 2)
    a.release("drained", retries_used=1)
    assert b.claim(), "the released generation is free for b"
    assert (b.retries_used, b.resumptions_left) == (1, 1)
    b.release("drained", retries_used=2)
    assert a.claim() and (a.retries_used, a.resumptions_left) == (2, 0)


def test_a_later_cluster_waits_for_an_earlier_one_only_when_that_one_was_admitted_too(tmp_path, monkeypatch):
    """A tie goes to the earlier cluster; a step whose earlier clusters are full claims at once on a later one."""
    from rayslice.cluster import set_member
    from tests.conftest import wait_until

    slept: list[float] = []
    monkeypatch.setattr(set_member.time, "sleep", lambda s: slept.append(s))
    a, b = member(tmp_path / "1", "a"), member(tmp_path / "1", "b")
    b.must_stand_by()
    assert b.claim() and slept == [], "a was never admitted: b claims without waiting"

    a, b = member(tmp_path / "2", "a"), member(tmp_path / "2", "b")
    a.must_stand_by()
    a.admitted()  # its note is written off the step's path
    assert wait_until(lambda: "a" in a.claims.admitted(0), timeout=10)
    slept.clear()  # (the wait above slept too)
    b.must_stand_by()
    assert b.claim(), "a was admitted but has not claimed: after its preference, b claims"
    assert slept == [set_member.PREFERENCE_STEP_S], "a was admitted too: b gives it its preference first"
