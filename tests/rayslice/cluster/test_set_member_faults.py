"""A launcher's part in a set's step under faults (issue 53, found by review), cluster-free: claims in a local
folder; the admission broker stood in for by a place that is admitted at once."""

from __future__ import annotations

import rayslice.cluster as launcher
from rayslice.cluster import phases
from rayslice.cluster import queue as admission
from rayslice.cluster.set_member import SetMember
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.cluster_claim import Claims, ClusterSet
from rayslice.core.step import Owner, StepSpec


def test_a_step_with_no_set_retries_left_is_no_priority_victim_on_the_next_cluster(tmp_path, monkeypatch):
    spec = StepSpec(command=["true"], request=TpuSliceRequest(tpu="v6e-4"), preemption_retries=1, preemptible=True,
                    priority=1, owner=Owner(dag_id="d", run_id="r", task_id="t", submission_id="sid"),
                    cluster_set=ClusterSet(name="tpus", members=("a", "b"), member="b"))
    # Cluster a ran the step, a notice suspended it there: it used the set's one preemption retry and released.
    on_a = Claims(f"file://{tmp_path}", member="a", submission_id="sid")
    assert on_a.take().held_by("a", "sid")
    on_a.release(0, "drained", retries_used=1)

    monkeypatch.setattr(admission.Place, "join", lambda self: (self.admitted.set(), self)[1])
    monkeypatch.setattr(admission.Place, "wait", lambda self, timeout: 0.0)
    monkeypatch.setattr(admission.Place, "leave", lambda self: None)
    member = SetMember(spec, f"file://{tmp_path}", log=lambda line: None)
    waits = launcher.Waits(capacity=60.0, start=60.0, member=member)
    waits.resumptions_left = spec.preemption_retries  # as `_attempts` sets it for b's first attempt
    place = launcher._admit(spec, waits, phases.Timeline())
    launcher._claim_or_give_back(waits, lambda: None)  # b's capacity is held: b claims generation 1
    assert member.generation == 1 and member.resumptions_left == 0
    assert not place.entry.preemptible, "held as a priority victim with no preemption retry left on the set"


def test_a_storage_blip_as_the_claim_is_released_does_not_end_a_resumable_step(tmp_path, monkeypatch):
    from rayslice.cluster import set_member

    monkeypatch.setattr(set_member.time, "sleep", lambda s: None)  # the retries' back-off, not the point here
    spec = StepSpec(command=["true"], request=TpuSliceRequest(tpu="v6e-4"), preemption_retries=2,
                    owner=Owner(dag_id="d", run_id="r", task_id="t", submission_id="sid"),
                    cluster_set=ClusterSet(name="tpus", members=("a", "b"), member="a"))
    a = SetMember(spec, f"file://{tmp_path}", log=lambda line: None)
    assert a.claim()
    real_create = Claims._create_whole
    blips = {"left": 1}

    def flaky_create(self, name, data):
        if name == "released-0.json" and blips["left"]:
            blips["left"] -= 1
            raise OSError("503 Service Unavailable")
        return real_create(self, name, data)

    monkeypatch.setattr(Claims, "_create_whole", flaky_create)
    a.release("drained", retries_used=1)  # every host ended: the step resumes on whichever cluster admits it
    b = Claims(f"file://{tmp_path}", member="b", submission_id="sid")
    assert b.take().held_by("b", "sid"), "generation 0 was never released: no cluster can resume the step"
