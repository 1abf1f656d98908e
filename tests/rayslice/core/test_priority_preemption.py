"""Which running steps a waiting request suspends under `preemption: lower-priority` (`rayslice.core.queue.victims`)."""

from __future__ import annotations

import pytest

from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.queue import QueueSettings, entry_for, victims


def running(id: str, priority: int, slices: int = 1, admitted_at: float = 0.0, preemptible: bool = True,
            tpu: str = "v6e-16"):
    e = entry_for(TpuSliceRequest(tpu=tpu, num_slices=slices), id=id, label=id, priority=priority,
                  preemptible=preemptible)
    e.admitted, e.admitted_at = True, admitted_at
    return e


def asking(priority: int, slices: int = 1, tpu: str = "v6e-16"):
    return entry_for(TpuSliceRequest(tpu=tpu, num_slices=slices), id="urgent", label="urgent", priority=priority)


def ids(chosen) -> list[str]:
    return [e.id for e in chosen]


def test_nothing_is_suspended_when_no_running_step_is_both_preemptible_and_of_lower_priority():
    held = [running("pinned", 0, preemptible=False), running("equal", 10)]
    assert victims(asking(10), held, total=2) == []


def test_a_request_that_fits_already_suspends_nothing():
    assert victims(asking(10), [running("train", 0)], total=2) == []


def test_the_lowest_priority_goes_first_then_the_youngest_and_only_as_many_as_needed():
    held = [running("old-low", 0, admitted_at=100), running("young-low", 0, admitted_at=200),
            running("mid", 5, admitted_at=300), running("high", 9, admitted_at=400)]
    assert ids(victims(asking(10), held, total=4)) == ["young-low"]
    assert ids(victims(asking(10, slices=2), held, total=4)) == ["young-low", "old-low"]
    assert ids(victims(asking(6, slices=3), held, total=4)) == ["young-low", "old-low", "mid"]


def test_the_two_slice_training_step_is_suspended_for_a_one_slice_evaluation():
    assert ids(victims(asking(10), [running("train", 0, slices=2)], total=2)) == ["train"]


def test_a_step_taken_early_that_turns_out_unneeded_is_given_back():
    # Lowest first takes "small" (1 slice), then "big" (2 slices) makes room for 2; "small" alone was not needed.
    held = [running("small", 0, admitted_at=1), running("big", 1, slices=2, admitted_at=2)]
    assert ids(victims(asking(10, slices=2), held, total=3)) == ["big"]


def test_a_request_that_two_suspensions_would_not_satisfy_suspends_nothing():
    held = [running("a", 0), running("b", 1), running("pinned", 0, preemptible=False)]
    assert victims(asking(10, slices=3), held, total=3) == []


def test_capacity_already_being_freed_counts_and_its_step_is_not_chosen_twice():
    held = [running("a", 0, admitted_at=1), running("b", 0, admitted_at=2)]
    assert victims(asking(10), held, total=2, suspending=frozenset({"b"})) == []
    assert ids(victims(asking(10, slices=2), held, total=2, suspending=frozenset({"b"}))) == ["a"]


def test_only_steps_of_the_kind_asked_for_are_candidates():
    held = [running("other-type", 0, tpu="v6e-4"), running("same", 0)]
    assert ids(victims(asking(10), held, total=1)) == ["same"]


def test_an_autoscaled_kind_or_a_chip_share_never_suspends():
    chips = entry_for(AcceleratorRequest(resource="TPU", count=4), id="c", label="c", priority=10,
                      chips_on=("v6e-16", 16))
    assert victims(chips, [running("train", 0)], total=1) == []
    assert victims(asking(10), [running("train", 0)], total=float("inf")) == []


def test_the_policy_is_opt_in_and_a_typo_is_refused_naming_the_choices():
    assert QueueSettings().preemption == "never"
    assert QueueSettings.checked({"preemption": "lower-priority"}, "RAYSLICE_QUEUE").preemption == "lower-priority"
    with pytest.raises(ValueError, match="RAYSLICE_QUEUE"):
        QueueSettings.checked({"preemption": "always"}, "RAYSLICE_QUEUE")


def gpus(id: str, count: float, priority: int = 0, admitted_at: float | None = None, preemptible: bool = True):
    e = entry_for(AcceleratorRequest(resource="GPU", count=count), id=id, label=id, priority=priority,
                  preemptible=preemptible)
    if admitted_at is not None:
        e.admitted, e.admitted_at = True, admitted_at
    return e


def test_a_whole_gpu_request_suspends_what_frees_one_node_not_what_frees_the_cluster():
    """Reviewer of issue 38: victims counted GPUs cluster-wide while admission counts them per node. Nodes of 2 and
    3 GPUs, a preemptible 1-GPU step on the first and a 2-GPU one on the second: 2 GPUs are free cluster-wide, none
    on one node, so a 2-GPU priority-10 request waited and nothing was suspended."""
    held = [gpus("low-one", 1, admitted_at=1), gpus("pinned-pair", 2, admitted_at=2, preemptible=False)]
    urgent = gpus("urgent", 2, priority=10)
    assert ids(victims(urgent, held, total=5, devices=[2, 3])) == ["low-one"]
    assert victims(urgent, held, total=5) == []  # counted cluster-wide, it "fits" already
    assert victims(gpus("urgent", 4, priority=10), held, total=5, devices=[2, 3]) == []  # bigger than any node


def test_victims_pack_the_running_steps_in_the_order_the_plan_does():
    """Reviewer of issue 38: victims re-sorted the running steps by (admitted_at, id) while the plan packs them in
    admission order; steps admitted in one plan share admitted_at, so the two disagreed on where the room was.
    One 3-GPU node, 0.4, 0.4, 0.6, 0.6 admitted in that order: the plan finds no whole device free."""
    from rayslice.core.queue import plan

    held = [gpus(id, amount, admitted_at=1) for id, amount in (("d", 0.4), ("c", 0.4), ("b", 0.6), ("a", 0.6))]
    urgent = gpus("urgent", 1, priority=10)
    assert plan([*held, urgent], {"GPU": 3}, QueueSettings(), now=5, devices={"GPU": [3]}).admit == []
    assert ids(victims(urgent, held, total=3, devices=[3])) == ["a"]  # the youngest taken first, and it is enough
    assert plan([*held[:3], urgent], {"GPU": 3}, QueueSettings(), now=5, devices={"GPU": [3]}).admit == ["urgent"]
    whole = [gpus("w1", 1, admitted_at=1), gpus("w0", 1, admitted_at=1, preemptible=False),
             gpus("w2", 1, admitted_at=1, preemptible=False)]
    assert plan([*whole, urgent], {"GPU": 3}, QueueSettings(), now=5, devices={"GPU": [3]}).admit == []
    assert ids(victims(urgent, whole, total=3, devices=[3])) == ["w1"]
