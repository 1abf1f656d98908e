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
