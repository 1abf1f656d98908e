"""The admission queue's rules (`rayslice.core.queue`), without a cluster: order, policies, aging, quotas, wording."""

from __future__ import annotations

import pytest

from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.exceptions import InvalidRequestError
from rayslice.core.queue import QueueSettings, describe, entry_for, format_queue, plan, standing

TOTALS = {"v6e-16": 2, "v6e-4": 1, "GPU": 3}
BEST_EFFORT = QueueSettings()
STRICT = QueueSettings(policy="strict")


def tpu(id, tpu="v6e-16", slices=1, at=0.0, priority=0, team=None, admitted=False):
    entry = entry_for(TpuSliceRequest(tpu=tpu, num_slices=slices), id=id, label=f"dag.{id}", priority=priority,
                      team=team, arrival=at)
    entry.admitted = admitted
    return entry


def test_a_waiting_two_slice_request_holds_back_later_one_slice_requests_of_its_type():
    entries = [tpu("run", admitted=True), tpu("big", slices=2, at=1), tpu("small", at=2), tpu("tiny", "v6e-4", at=3)]
    decided = plan(entries, TOTALS, BEST_EFFORT, now=10)
    assert decided.admit == ["tiny"]  # best-effort: the v6e-4 is capacity the big request cannot use
    assert decided.reasons.get("small", "") == ""  # behind the big one, in its own line
    entries[0].admitted = False  # the running step left: the big one is served first
    entries.pop(0)
    assert plan(entries, TOTALS, STRICT, now=10).admit == ["big", "tiny"]


def test_strict_and_aged_requests_hold_back_only_capacity_they_could_use():
    """Issue 38 (5): a strict or aged 2 x v6e-16 held back every v6e-4 of a static cluster, for hours."""
    entries = [tpu("run", admitted=True), tpu("old", slices=2, at=0), tpu("small", at=1), tpu("tiny", "v6e-4", at=2)]
    for settings, now in ((STRICT, 10), (QueueSettings(aging_s=60), 61)):
        decided = plan(entries, TOTALS, settings, now=now)
        assert decided.admit == ["tiny"], settings  # the v6e-4 is no slice the 2 x v6e-16 could use
        assert decided.reasons.get("small", "") == ""  # its own line waits behind it


def test_priority_first_then_arrival():
    entries = [tpu("early", at=1), tpu("late-high", at=2, priority=5), tpu("later", at=3)]
    assert plan(entries, {"v6e-16": 1}, BEST_EFFORT, now=5).admit == ["late-high"]
    state = standing(entries, "later", plan(entries, {"v6e-16": 0.5}, BEST_EFFORT, now=5).reasons, now=5)
    assert describe(state) == "waiting for 1 x v6e-16: 3rd in line behind dag.early (priority 0, waiting 4 s)"


def test_a_team_over_its_quota_borrows_only_what_nobody_within_quota_waits_for():
    settings = QueueSettings(quotas={"a": {"v6e-16": 16}, "b": {"v6e-16": 16}})
    entries = [tpu("a1", team="a", admitted=True), tpu("a2", team="a", at=1), tpu("b1", team="b", at=2)]
    decided = plan(entries, TOTALS, settings, now=3)
    assert decided.admit == ["b1"]  # a2 arrived first, but is over team a's quota while b waits within its own
    assert "team a over its quota (16 of 16 v6e-16 in use)" in decided.reasons["a2"]
    assert plan(entries[:2], TOTALS, settings, now=3).admit == ["a2"]  # nobody else waits: it borrows


def test_fractions_share_accelerators_and_the_queue_table_reads_in_order():
    gpu = [entry_for(AcceleratorRequest(resource="GPU", count=c), id=f"g{i}", label=f"d.g{i}", arrival=i)
           for i, c in enumerate([2, 2, 0.5])]
    assert plan(gpu, TOTALS, BEST_EFFORT, now=5).admit == ["g0"]  # g1 does not fit; g2 must not pass it
    table = format_queue([e.to_json() for e in gpu], now=5)
    assert [line.split()[-1] for line in table.splitlines()[1:]] == ["d.g0", "d.g1", "d.g2"]


def test_capacity_an_autoscaler_would_add_counts_as_fitting():
    assert plan([tpu("x", "v5p-8")], TOTALS, STRICT, now=1).admit == ["x"]


def test_queue_settings_are_checked():
    with pytest.raises(ValueError, match="policy"):
        QueueSettings(policy="fifo")


# ---- issue 38: careless and hostile steps, at scale

def chips(id, count, on=("v6e-16", 16), at=0.0, admitted=False):
    entry = entry_for(AcceleratorRequest(resource="TPU", count=count), id=id, label=f"dag.{id}", arrival=at,
                      chips_on=on)
    entry.admitted = admitted
    return entry


def test_tpu_chip_steps_wait_in_the_line_of_the_slice_type_they_run_on():
    """(1) Four TPU x4 steps used to be admitted onto the free v6e-16 a waiting 2 x v6e-16 needs."""
    entries = [tpu("run", admitted=True), tpu("big", slices=2, at=1), *(chips(f"c{i}", 4, at=2 + i) for i in range(4))]
    decided = plan(entries, {"v6e-16": 2}, BEST_EFFORT, now=10)
    assert decided.admit == []
    assert [e.kind for e in entries[2:]] == ["v6e-16"] * 4 and entries[2].what == "4 TPU chips of a v6e-16"
    entries.pop(1)  # nobody waits for whole slices: four chip steps share one slice, a fifth does not fit beside
    entries += [chips("c4", 4, at=9), tpu("one", at=10)]   # a one-slice request after them: the second slice
    assert plan(entries, {"v6e-16": 2}, BEST_EFFORT, now=10).admit == ["c0", "c1", "c2", "c3"]
    entries.pop(0)  # the running one-slice step ended: c0-c3 fill one slice, c4 needs another, then `one` waits
    assert plan(entries, {"v6e-16": 2}, BEST_EFFORT, now=10).admit == ["c0", "c1", "c2", "c3", "c4"]


def test_chip_steps_run_on_the_smallest_slice_type_of_their_generation_packed_onto_one_slice():
    from rayslice.cluster.queue import chip_label_selector, chip_slice

    def node(id, pod, slice_name, worker, chips=4):
        return {"NodeID": id, "Alive": True, "Resources": {"TPU": chips},
                "Labels": {"ray.io/tpu-pod-type": pod, "ray.io/tpu-slice-name": slice_name,
                           "ray.io/tpu-worker-id": str(worker)}}

    nodes = [node(f"a{w}", "v6e-16", "a", w) for w in range(4)] + [node(f"b{w}", "v6e-16", "b", w) for w in range(4)]
    request = AcceleratorRequest(resource="TPU", count=4)
    assert chip_slice(request, nodes) == ("v6e-16", 16)
    assert chip_slice(request, [*nodes, node("s", "v6e-4", "s", 0)]) == ("v6e-4", 4)  # single-host first
    assert chip_slice(AcceleratorRequest(resource="TPU", count=4, accelerator_type="TPU-V5P"), nodes) is None
    free = {f"a{w}": {"TPU": 4} for w in range(4)} | {f"b{w}": {"TPU": 4 if w else 0} for w in range(4)}
    # slice b already holds a chip step: the next goes there too, so slice a stays whole
    assert chip_label_selector("v6e-16", 4, nodes, free) == {"ray.io/tpu-pod-type": "v6e-16",
                                                             "ray.io/tpu-slice-name": "b"}


def test_quotas_count_against_the_team_and_every_team_above_it():
    """(3) A sub-team is still bounded by its parent's quota."""
    settings = QueueSettings(quotas={"a": {"v6e-16": 16}})
    entries = [tpu("a1", team="a/x", admitted=True), tpu("a2", team="a/y", at=1), tpu("b1", team="b", at=2)]
    decided = plan(entries, TOTALS, settings, now=3)
    assert decided.admit == ["b1"]
    assert "team a over its quota (16 of 16 v6e-16 in use)" in decided.reasons["a2"]


def test_settings_from_a_newer_writer_are_read_and_a_person_gets_a_clear_error():
    """(6) An old broker refused every heartbeat once settings carried a field it did not know."""
    assert QueueSettings.model_validate({"policy": "strict", "fair_share": True}) == STRICT
    with pytest.raises(InvalidRequestError, match="unknown key\\(s\\) aging"):
        QueueSettings.checked('{"aging": 5}', "RAYSLICE_QUEUE")
    assert QueueSettings.checked({"policy": "strict"}, "x") == STRICT


def test_a_log_line_names_only_steps_of_its_own_dag():
    """(12) "behind etl.train" named another team's DAG in a task log its readers may not read."""
    mine, same, other = (tpu(id, slices=2, at=at) for id, at in (("mine", 3), ("same", 2), ("other", 1)))
    mine.dag, same.dag, other.dag = "prod/train", "prod/train", "prod/etl"
    entries = [tpu("run", admitted=True), other, same, mine]
    assert standing(entries, "mine", {}, now=5)["ahead"]["label"] == "dag.same"
    assert standing(entries, "same", {}, now=5)["ahead"]["label"] == "a step of another DAG"


def test_the_operator_caps_what_priority_a_step_may_ask():
    """A step asking priority=10**9 to jump the line is queued at its team's cap (the operator's `max_priority`)."""
    settings = QueueSettings(max_priority={"*": 10, "oncall": 100, "research/vision": 5})
    assert settings.priority_of(10**9, None) == 10 and settings.priority_of(3, None) == 3
    assert settings.priority_of(10**9, "oncall") == 100
    assert settings.priority_of(10**9, "research/vision/x") == 5  # a team above it caps it too
    assert QueueSettings().priority_of(10**9, "any") == 10**9  # no cap set: as asked


def gpu(id, count, at=0.0, admitted=False):
    entry = entry_for(AcceleratorRequest(resource="GPU", count=count), id=id, label=f"dag.{id}", arrival=at)
    entry.admitted = admitted
    return entry


def test_a_whole_gpu_is_admitted_only_onto_a_whole_free_device_and_fractions_pack():
    """Issue 38 (7): fractions were summed over the cluster. Three 0.6 GPU steps on a 3-GPU node leave 1.2
    GPUs "free", so a 1-GPU step was admitted with no device free, and Ray's fractions took the devices first."""
    running = [gpu(f"r{i}", 0.6, admitted=True) for i in range(3)]
    waiting = [gpu("whole", 1, at=1), gpu("fifth", 0.2, at=2)]
    devices = {"GPU": [3]}  # one node, three devices
    assert plan([*running, *waiting], TOTALS, BEST_EFFORT, now=5, devices=devices).admit == []
    assert plan([*running[1:], *waiting], TOTALS, BEST_EFFORT, now=5, devices=devices).admit == ["whole", "fifth"]
    # a 0.5 and a 0.75 never share a device; two halves do, leaving the other device whole
    assert plan([gpu("a", 0.5, admitted=True), gpu("b", 0.75, at=1), gpu("c", 1, at=2)], TOTALS, BEST_EFFORT,
                now=5, devices={"GPU": [2]}).admit == ["b"]
    assert plan([gpu("a", 0.5, admitted=True), gpu("b", 0.5, at=1), gpu("c", 1, at=2)], TOTALS, BEST_EFFORT,
                now=5, devices={"GPU": [2]}).admit == ["b", "c"]
    # two whole GPUs on one node: two nodes of one free device each do not make them
    assert plan([gpu("one", 1, admitted=True), gpu("pair", 2, admitted=True), gpu("two", 2, at=1)], TOTALS,
                BEST_EFFORT, now=5, devices={"GPU": [2, 3]}).admit == []


def test_a_whole_gpu_request_bigger_than_any_node_is_refused_when_it_asks():
    """Reviewer of issue 38 (7): a 4-GPU step on 2-GPU nodes never fitted, so every GPU step behind it waited out
    its capacity_timeout. It is refused at once, in words that say what the nodes have."""
    from rayslice.core.queue import refusal

    devices = {"GPU": [2, 1]}
    assert refusal(gpu("huge", 4), TOTALS, set(), devices) == (
        "4 GPU can never run on this cluster: a step's GPU must be on one node, and its largest GPU node has 2 "
        "(nodes: 2, 1); ask for at most 2, or add a bigger node")
    assert refusal(gpu("pair", 2), TOTALS, set(), devices) is None
    assert refusal(gpu("half", 0.5), TOTALS, set(), devices) is None
    assert refusal(gpu("huge", 4), {"GPU": float("inf")}, {"GPU"}, devices) is None  # an autoscaler may add one


def test_an_autoscaled_kind_is_admitted_up_to_what_its_node_groups_can_hold():
    """Issue 38 (4): every autoscaled kind counted as unbounded, so everything was admitted at once."""
    from rayslice.core.queue import refusal

    waiting = [tpu(f"s{i}", at=i) for i in range(3)] + [tpu("big", slices=3, at=9)]
    limits, autoscaled = {"v6e-16": 2}, {"v6e-16"}
    assert plan(waiting[:3], limits, BEST_EFFORT, now=10, autoscaled=autoscaled).admit == ["s0", "s1"]
    assert refusal(waiting[3], limits, autoscaled) is not None and "at most 2 v6e-16" in refusal(
        waiting[3], limits, autoscaled)
    assert "none of its autoscaler's node groups provides v5p-8" in refusal(tpu("x", "v5p-8"), {"v5p-8": 0},
                                                                           {"v5p-8"})
    assert refusal(waiting[0], limits, autoscaled) is None and refusal(tpu("y"), {"v6e-16": 1}, set()) is None


def test_a_team_with_thousands_of_steps_over_its_quota_is_not_checked_step_by_step(monkeypatch):
    """Issue 38 (scale): steps over a quota do not stop a line's walk, so a team with 2,000 of them made every plan
    check each one against its quota and format a reason for each (20 ms at 10,000, `bench/queue_plan_quota.py`).
    Now one check per team, kind and size: the rest is a lookup. The plan is the same: the step of another team
    behind them is admitted, the first of them borrows what nobody else waits for, and each has its reason."""
    from rayslice.core import queue as rules

    settings = QueueSettings(quotas={"hog": {"v6e-16": 16}})
    hog = [tpu(f"h{i}", team="hog", at=1 + i) for i in range(2000)]
    entries = [tpu("held", team="hog", admitted=True), *hog, tpu("other", team="b", at=5000)]
    checks = []
    real = rules.teams_above
    monkeypatch.setattr(rules, "teams_above", lambda team: checks.append(team) or real(team))
    decided = plan(entries, {"v6e-16": 3}, settings, now=6000)
    assert decided.admit == ["other", "h0"]  # within quota first; then h0 borrows the slice nobody else waits for
    assert len(checks) < 20, len(checks)  # counting the running and admitted steps, and the first checks
    assert decided.reasons["h1"] == decided.reasons["h1999"] == (
        "team hog over its quota (32 of 16 v6e-16 in use), borrowing only what nobody within quota waits for")
    assert set(decided.reasons) == {f"h{i}" for i in range(1, 2000)}


def test_the_reason_names_the_first_team_over_its_quota_from_the_top_as_each_step_is_met():
    """What a team uses grows during a plan: a research/vision step first met over its own quota may later be over
    research's too, and then, as for every step, the reason names research (checked from the top). Found by
    comparing the plans of the per-step check and of the cached one on random queues."""
    settings = QueueSettings(quotas={"research": {"v6e-16": 48}, "research/vision": {"v6e-16": 16}})
    entries = [tpu("held", team="research/vision", admitted=True), tpu("v1", team="research/vision", at=1),
               tpu("n1", team="research/nlp", at=2), tpu("n2", team="research/nlp", at=3),
               tpu("v2", team="research/vision", at=4)]
    decided = plan(entries, {"v6e-16": 3}, settings, now=10)
    assert decided.admit == ["n1", "n2"]
    assert decided.reasons["v1"].startswith("team research/vision over its quota (16 of 16")  # met first
    assert decided.reasons["v2"].startswith("team research over its quota (48 of 48")  # met once n1, n2 were in


def test_a_step_right_behind_an_elastic_one_over_quota_is_checked_for_its_own_size():
    """An elastic step is checked for its fewest slices, so its team's finding says nothing of which team a
    step of its full size is over first."""
    settings = QueueSettings(quotas={"research": {"v6e-16": 32}, "research/vision": {"v6e-16": 0}})
    elastic = entry_for(TpuSliceRequest(tpu="v6e-16", num_slices=(1, 3)), id="grow", label="dag.grow",
                        team="research/vision", arrival=1)
    entries = [tpu("other", team="b", admitted=True), elastic, tpu("fixed", slices=3, team="research/vision", at=2)]
    decided = plan(entries, {"v6e-16": 1}, settings, now=10)
    assert decided.reasons["grow"].startswith("team research/vision over its quota")
    assert decided.reasons["fixed"].startswith("team research over its quota"), decided.reasons


def test_a_step_between_two_attempts_keeps_its_place_and_nobody_it_outranks_passes_it():
    """Issue 49 (1): a suspended step left the queue before it rejoined, and in between a later, lower-ranked step
    was admitted onto its slices. Between attempts it stays in line (`rejoining`): the urgent step ahead of it is
    admitted, the later one waits, and the rejoining step itself starts nothing until its launcher asks again."""
    victim, urgent, later = tpu("v", slices=2, at=0), tpu("h", at=5, priority=10), tpu("l", at=3)
    victim.rejoining = True
    decided = plan([victim, urgent, later], TOTALS, BEST_EFFORT, now=10)
    assert decided.admit == ["h"]
    assert not decided.reasons["v"].startswith("first in line")  # it suspends nobody while it is away
    over = tpu("v2", at=0, team="a")  # a borrower between attempts starts nothing either
    over.rejoining = True
    assert plan([over], TOTALS, QueueSettings(quotas={"a": {"v6e-16": 0}}), now=1).admit == []
    victim.rejoining = False  # back with its next attempt: first in line, ahead of the later step
    assert plan([victim, later], TOTALS, BEST_EFFORT, now=10).admit == ["v"]


def test_an_elastic_request_is_granted_only_slices_with_every_host():
    """Issue 49 (2): a (1, 3) step was admitted on 3 slices when one had lost a host: it waited its whole
    capacity_timeout in the reservation, and failed, while the queue counted 3 slices as held."""
    e = entry_for(TpuSliceRequest(tpu="v6e-16", num_slices=(1, 3), multislice=True, elastic_wait=0), id="e",
                  label="d.e", arrival=0)
    decided = plan([e], {"v6e-16": 3}, BEST_EFFORT, now=1, intact={"v6e-16": 2})
    assert decided.admit == ["e"] and decided.amounts["e"] == 2
    assert plan([e], {"v6e-16": 3}, BEST_EFFORT, now=1).amounts["e"] == 3  # without the count: as before
    fixed = tpu("f", slices=3)  # a fixed request still waits for the hosts to come back (Ray places it then)
    assert plan([fixed], {"v6e-16": 3}, BEST_EFFORT, now=1, intact={"v6e-16": 2}).admit == ["f"]
