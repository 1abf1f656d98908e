"""The broker's bookkeeping without a cluster (issue 38 (6)): what one heartbeat costs, and when places expire.

The broker's class is driven directly, with Ray's runtime context, the GCS keys, the cluster's capacity
and the clock replaced: what is counted is how often it plans, never how long anything takes.
"""

from __future__ import annotations

import pytest

from rayslice.cluster import queue
from rayslice.core import queue as rules
from rayslice.core.accelerators import TpuSliceRequest

REAL_CAPACITY = queue.Broker.__ray_actor_class__._capacity


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def broker(monkeypatch):
    return make_broker(monkeypatch, {"v6e-16": 2, "v6e-4": 1})


def make_broker(monkeypatch, capacity: dict[str, float]):
    """The broker's plain class with a fake clock, GCS keys in a dict, and `capacity` as the cluster's."""
    kv: dict[str, bytes] = {}
    clock = Clock()
    monkeypatch.setattr(queue, "_kv_get", kv.get, raising=False)
    monkeypatch.setattr(queue, "_kv_put", kv.__setitem__, raising=False)
    monkeypatch.setattr(queue.time, "monotonic", clock)
    monkeypatch.setattr(queue.time, "time", clock)
    monkeypatch.setattr(queue.ray, "get_runtime_context",
                        lambda: type("Context", (), {"was_current_actor_reconstructed": False})())
    Broker = queue.Broker.__ray_actor_class__  # the plain class under @ray.remote
    monkeypatch.setattr(Broker, "_capacity", lambda self, kinds: (dict(capacity), set(), {}))
    plans = []
    real = rules.plan_lines  # what the broker plans with (rules.plan is the one-shot form)
    monkeypatch.setattr(rules, "plan_lines", lambda *a, **k: plans.append(1) or real(*a, **k))
    # The probe the broker sends itself through its queue: through at once, or (`backlogged`) held in `probes`
    # until the test says the calls queued before it have run.
    monkeypatch.setattr(Broker, "_send_probe", lambda self, at: self.probes.append(at)
                        if getattr(self, "backlogged", False) else self.caught_up_to(at), raising=False)
    b = Broker()
    b.probes, b.backlogged = [], False
    b.clock, b.kv, b.plans = clock, kv, plans
    return b


def entry(i, tpu="v6e-16", at=0.0):
    return rules.entry_for(TpuSliceRequest(tpu=tpu), id=f"e{i}", label=f"d.e{i}", arrival=at + i).to_json()


def test_a_heartbeat_does_not_replan_the_queue(broker):
    """Every beat used to re-plan (and re-sort) the whole queue: 5.4 ms a beat at 1,000 waiting."""
    for i in range(1000):
        broker.heartbeat(entry(i))
        broker.clock.now += 0.0001  # 1,000 arrivals in 0.1 s: planned together, not one by one
    assert 1 <= len(broker.plans) <= 3  # at least one: the counter sees the broker's plans
    broker.clock.now += queue.PLAN_S
    before = len(broker.plans)
    for i in range(1000):  # a round of beats from places already known: nothing changed, nothing to plan
        state = broker.heartbeat(entry(i))
    assert len(broker.plans) - before <= 1
    assert state["rank"] == 998 and state["beat_s"] == queue.SLOW_BEAT_S  # far back: beats slowly
    assert broker.heartbeat(entry(5))["beat_s"] == queue.HEARTBEAT_S  # near the front (4th): beats often


def test_a_slow_beating_place_is_kept_and_a_silent_one_expires(broker):
    clock = broker.clock
    broker.heartbeat(entry(0, tpu="v6e-4"))  # admitted: holds the v6e-4
    broker.heartbeat(entry(1, tpu="v6e-4"), beat_s=queue.SLOW_BEAT_S)
    for _ in range(4):  # two slow beats missed: still there
        clock.now += queue.SLOW_BEAT_S / 2
        broker.heartbeat(entry(0, tpu="v6e-4"))
    assert set(broker.entries) == {"e0", "e1"}
    for _ in range(4):  # three missed: gone (once a probe sent after its deadline has come through)
        clock.now += queue.SLOW_BEAT_S / 2
        broker.heartbeat(entry(0, tpu="v6e-4"))
    assert set(broker.entries) == {"e0"} and broker.expired == 1


def test_no_place_expires_while_its_beats_wait_behind_a_backlog(broker):
    """Issue 38, scale: at 10,000 waiting, 273 live places expired while the broker worked through bursts of
    2,500 leaves: its sweep ran on those calls, at its own clock, with the places' beats queued behind them.

    Expiry is measured against what the broker has processed: a probe it sends itself through its own
    queue. One of the burst's callers has a clock an hour ahead (it used to move the sweep's clock to the
    broker's now, expiring every place whose beat waited behind the burst).
    """
    clock = broker.clock
    for i in range(4):  # e0 runs on the v6e-4; e1..e3 wait
        broker.heartbeat(entry(i, tpu="v6e-4"), sent=clock.now)
    for i in range(100, 2600):
        broker.heartbeat(entry(i, tpu="v6e-16"), beat_s=queue.SLOW_BEAT_S, sent=clock.now)
    burst = clock.now + 0.1  # a process leaves its 2,500 places at once; e0..e3 beat right after (sent 0.2 s later)
    broker.backlogged = True  # from here the broker's queue holds the burst: a probe waits behind it
    for i in range(100, 2600):
        clock.now += 0.01  # the broker works through the burst for 25 s: far past every 3-beat deadline
        broker.leave(f"e{i}", sent=burst + 3600 if i == 2599 else burst)
    assert broker.expired == 0 and {"e0", "e1", "e2", "e3"} <= set(broker.entries)
    clock.now += queue.HEARTBEAT_S
    for i in range(4):  # their beats come through, sent before the deadline
        state = broker.heartbeat(entry(i, tpu="v6e-4"), sent=burst + 0.2)
    assert broker.expired == 0 and not state["admitted"]
    broker.caught_up_to(broker.probes.pop(0))  # then the probe sent as the burst began
    assert [e.id for e in broker.running.values()] == ["e0"]  # nobody else admitted onto e0's v6e-4
    broker.backlogged = False
    for _ in range(6):  # caught up, and e3's launcher is gone: its place expires
        clock.now += 2 * queue.HEARTBEAT_S
        for i in range(3):
            broker.heartbeat(entry(i, tpu="v6e-4"), sent=clock.now)
    assert "e3" not in broker.entries and broker.expired == 1


def test_a_step_of_the_heads_wall_clock_expires_nobody(broker, monkeypatch):
    """NTP steps the head's clock an hour ahead while the launchers' stay: no place is lost, none skipped."""
    for i in range(4):
        broker.heartbeat(entry(i, tpu="v6e-4"))
    monkeypatch.setattr(queue.time, "time", lambda: broker.clock.now + 3600)
    for _ in range(3):
        broker.clock.now += queue.HEARTBEAT_S
        states = [broker.heartbeat(entry(i, tpu="v6e-4")) for i in range(4)]
    assert broker.expired == 0 and set(broker.entries) == {"e0", "e1", "e2", "e3"}
    assert [s.get("rank") for s in states] == [None, 1, 2, 3] and states[0]["admitted"]


def test_a_broker_made_anew_while_places_were_held_holds_admissions_until_they_are_back(broker, monkeypatch):
    """Issue 38 (2): a broker killed for good and made anew admitted the first launcher to beat, alone."""
    broker.heartbeat(entry(0, tpu="v6e-4"))
    assert broker.kv[queue.BUSY_KEY] == b"1"
    fresh = type(broker)()  # the next launcher's get_if_exists: not a Ray restart
    state = fresh.heartbeat(entry(1, tpu="v6e-4"))  # the first to beat, alone: not admitted
    assert not state["admitted"] and state["reason"] == "the queue is being rebuilt after a restart"
    assert fresh.heartbeat({**entry(0, tpu="v6e-4"), "admitted": True})["admitted"]
    broker.clock.now += queue.RECOVERY_S
    assert fresh.heartbeat(entry(1, tpu="v6e-4"))["rank"] == 1  # the running step is back: e1 still waits
    fresh.leave("e0")
    fresh.leave("e1")
    broker.clock.now += queue.HEARTBEAT_S
    fresh.heartbeat(entry(2, tpu="v6e-16"))
    fresh.leave("e2")
    broker.clock.now += queue.HEARTBEAT_S
    fresh.snapshot()
    assert broker.kv[queue.BUSY_KEY] == b"0"
    assert type(broker)().hold_until == 0.0  # nobody held a place: a new broker admits at once


def test_a_step_asking_a_huge_priority_is_queued_at_the_operators_cap(broker):
    broker.settings = rules.QueueSettings(max_priority={"*": 0})
    broker.heartbeat(entry(0, tpu="v6e-4"))  # holds the v6e-4
    broker.heartbeat(entry(1, tpu="v6e-4"))
    jumper = rules.entry_for(TpuSliceRequest(tpu="v6e-4"), id="jumper", label="d.jumper", priority=10**9, arrival=9)
    state = broker.heartbeat(jumper.to_json())
    assert broker.entries["jumper"].priority == 0 and state["rank"] == 2  # behind e1, not ahead of it


def test_lower_priority_preemption_tells_the_chosen_steps_launcher_and_only_under_the_policy(broker):
    """A priority-10 evaluation waits behind a preemptible 2-slice training: the training's next beat says suspend."""
    train = rules.entry_for(TpuSliceRequest(tpu="v6e-16", num_slices=2), id="train", label="d.train", priority=0,
                            preemptible=True).to_json()
    assert broker.heartbeat(train)["admitted"]
    evaluation = rules.entry_for(TpuSliceRequest(tpu="v6e-16"), id="eval", label="d.eval", priority=10).to_json()
    broker.clock.now += queue.REPLAN_S
    assert not broker.heartbeat(evaluation)["admitted"]
    broker.clock.now += queue.REPLAN_S
    assert "suspend" not in broker.heartbeat(train)  # the policy is "never" by default
    broker.set_settings({"preemption": "lower-priority", "preemption_grace_s": 20})
    broker.clock.now += queue.REPLAN_S
    told = broker.heartbeat(train)
    assert told["suspend"].startswith("suspended for d.eval (priority 10") and told["grace_s"] == 20
    assert "suspended for d.eval" in next(e["reason"] for e in broker.snapshot()["entries"] if e["id"] == "train")
    broker.leave("train")  # its launcher released: the evaluation is admitted, the training requeues behind it
    broker.clock.now += queue.REPLAN_S
    assert broker.heartbeat(evaluation)["admitted"]
    assert broker.suspending == {}


def test_a_step_not_declared_preemptible_is_never_suspended(broker):
    broker.set_settings({"preemption": "lower-priority"})
    broker.clock.now += queue.REPLAN_S
    train = rules.entry_for(TpuSliceRequest(tpu="v6e-16", num_slices=2), id="train", label="d.train").to_json()
    assert broker.heartbeat(train)["admitted"]
    evaluation = rules.entry_for(TpuSliceRequest(tpu="v6e-16"), id="eval", label="d.eval", priority=10).to_json()
    broker.clock.now += queue.REPLAN_S
    broker.heartbeat(evaluation)
    broker.clock.now += queue.REPLAN_S
    assert "suspend" not in broker.heartbeat(train)

def test_an_autoscaling_cluster_admits_up_to_its_groups_maxima_and_refuses_what_none_provides(broker, monkeypatch):
    """Issue 38 (4): on an autoscaling cluster every kind counted as unbounded: all admitted at once, and a kind
    no node group provides waited out its whole capacity_timeout. Here the operator declares the maxima."""
    from rayslice.cluster import autoscaler

    Broker = type(broker)
    monkeypatch.setattr(Broker, "_capacity", REAL_CAPACITY)  # the broker's own reading of the cluster
    monkeypatch.setattr(queue.ray, "nodes", lambda: [])  # no TPU host yet: the autoscaler adds them
    monkeypatch.setattr(autoscaler, "may_add", lambda resource: True)
    monkeypatch.setattr(queue, "group_maxima", lambda: {}, raising=False)  # Ray's autoscaler reports no groups
    broker.settings = rules.QueueSettings(max_capacity={"v6e-16": 2})
    for i in range(3):
        broker.heartbeat(entry(i))
    broker.clock.now += 2 * queue.PLAN_S  # the arrivals are planned together
    states = [broker.heartbeat(entry(i)) for i in range(3)]
    assert [s["admitted"] for s in states] == [True, True, False]  # the group holds two: the third waits
    state = broker.heartbeat(entry(9, tpu="v5p-8"))
    assert "none of its autoscaler's node groups provides v5p-8" in state["refused"] and "e9" not in broker.entries
    big = rules.entry_for(TpuSliceRequest(tpu="v6e-16", num_slices=3), id="big", label="d.big", arrival=9)
    assert "at most 2 v6e-16" in broker.heartbeat(big.to_json())["refused"]


def test_a_stray_probe_changes_nothing_and_a_failed_send_is_tried_again(broker, monkeypatch):
    """Reviewer of issue 38: a call of `caught_up_to` stamped in the future expired every place at every sweep, and
    one failed probe send stopped expiry for the broker's whole life (its flag was set before the send)."""
    clock = broker.clock
    for i in range(3):
        broker.heartbeat(entry(i, tpu="v6e-4"))
    broker.caught_up_to(clock.now + 3600)  # not the probe on its way: ignored
    for _ in range(3):
        clock.now += queue.HEARTBEAT_S
        for i in range(3):
            broker.heartbeat(entry(i, tpu="v6e-4"))
    assert broker.expired == 0 and set(broker.entries) == {"e0", "e1", "e2"}

    failing = {"left": 2}

    def send(self, at):
        if failing["left"]:
            failing["left"] -= 1
            raise RuntimeError("the actor handle is not there yet")
        self.caught_up_to(at)

    monkeypatch.setattr(type(broker), "_send_probe", send)
    broker._probes = []
    for _ in range(12):  # e2's launcher is gone: its place expires once a probe gets through
        clock.now += queue.HEARTBEAT_S
        for i in range(2):
            broker.heartbeat(entry(i, tpu="v6e-4"))
    assert "e2" not in broker.entries and broker.expired == 1 and failing["left"] == 0


def test_a_backlog_longer_than_a_lost_probe_still_lets_places_expire(broker):
    """Second reviewer of issue 38: a probe taken as lost (resent after PROBE_LOST_S) was ignored when it came back,
    so with every probe queued longer than that, nothing ever expired and dead places held capacity."""
    clock = broker.clock
    for i in range(2):
        broker.heartbeat(entry(i, tpu="v6e-4"))  # e0 holds the v6e-4; e1's launcher dies now
    broker.backlogged = True
    for _ in range(6):  # a 40 s backlog: every probe comes back after PROBE_LOST_S, behind a resent one
        for _ in range(int(40 / queue.HEARTBEAT_S)):
            clock.now += queue.HEARTBEAT_S
            broker.heartbeat(entry(0, tpu="v6e-4"))
        broker.caught_up_to(broker.probes.pop(0))
    assert "e1" not in broker.entries and broker.expired == 1


def test_a_whole_gpu_step_is_refused_only_beyond_every_node_the_cluster_has_known(broker, monkeypatch):
    """Second reviewer of issue 38: the size check saw live nodes only, so a waiting 8-GPU step that re-registered
    (after a broker restart) while its 8-GPU node was down failed for good. Nodes down count; never-seen sizes not."""
    from rayslice.core.accelerators import AcceleratorRequest

    def gpus(id, count):
        return rules.entry_for(AcceleratorRequest(resource="GPU", count=count), id=id, label=f"d.{id}").to_json()

    monkeypatch.setattr(type(broker), "_capacity", lambda self, kinds: ({"GPU": 4}, set(), {"GPU": [4]}))
    broker._known_devices = {"GPU": [8, 4]}  # the 8-GPU node is down now (alive: the 4); Ray still knows it
    assert "refused" not in broker.heartbeat(gpus("big", 8))
    refused = broker.heartbeat(gpus("huge", 16))["refused"]
    assert refused.startswith("16 GPU can never run on this cluster") and "its largest GPU node has 8" in refused


def _slices(id, n=1, priority=0, preemptible=False, at=0.0):
    return rules.entry_for(TpuSliceRequest(tpu="v6e-16", num_slices=n), id=id, label=f"d.{id}", priority=priority,
                           preemptible=preemptible, arrival=1000.0 + at).to_json()


def _training_chosen_for_an_evaluation(broker) -> dict:
    """A preemptible 2-slice training runs; a priority-10 evaluation waits, and the plan chose the training."""
    broker.set_settings({"preemption": "lower-priority"})
    broker.clock.now += queue.REPLAN_S
    train = _slices("train", n=2, preemptible=True)
    assert broker.heartbeat(train)["admitted"]
    broker.clock.now += queue.REPLAN_S
    evaluation = _slices("eval", priority=10, at=1)
    broker.heartbeat(evaluation)
    broker.clock.now += queue.REPLAN_S
    broker.heartbeat(evaluation)
    return train


def test_a_suspension_whose_request_left_before_its_step_heard_it_is_taken_back(broker):
    """The evaluation that asked is cancelled right after the plan chose the training: nobody needs its slice."""
    train = _training_chosen_for_an_evaluation(broker)
    assert "train" in broker.suspending
    broker.leave("eval")
    broker.clock.now += queue.REPLAN_S
    assert "suspend" not in broker.heartbeat(train)


def test_a_suspension_is_taken_back_when_its_request_is_admitted_on_capacity_freed_otherwise(broker):
    broker.set_settings({"preemption": "lower-priority"})
    broker.clock.now += queue.REPLAN_S
    assert broker.heartbeat(_slices("a"))["admitted"]
    broker.clock.now += queue.REPLAN_S
    victim = _slices("v", preemptible=True, at=1)
    assert broker.heartbeat(victim)["admitted"]
    urgent = _slices("h", priority=10, at=2)
    broker.clock.now += queue.REPLAN_S
    broker.heartbeat(urgent)
    broker.clock.now += queue.REPLAN_S
    broker.heartbeat(urgent)
    assert "v" in broker.suspending
    broker.leave("a")  # it ended by itself: the request runs on its slice
    broker.clock.now += queue.REPLAN_S
    assert broker.heartbeat(urgent)["admitted"]
    broker.clock.now += queue.REPLAN_S
    assert "suspend" not in broker.heartbeat(victim)


def test_a_suspension_its_step_heard_stands(broker):
    train = _training_chosen_for_an_evaluation(broker)
    assert "suspend" in broker.heartbeat(train)  # heard: its hosts are checkpointing now
    broker.leave("eval")
    broker.clock.now += queue.REPLAN_S
    assert "suspend" in broker.heartbeat(train)


def test_what_a_launcher_sends_never_changes_the_operators_policy_or_quotas(broker):
    """Issue 38 (3), without a cluster: a launcher's `settings` (as launchers before it sent) and unknown
    arguments from a newer launcher are ignored; the team over quota stays held."""
    broker.set_settings({"quotas": {"g": {"v6e-4": 0}}})  # planned now: the two below are planned together
    greedy = rules.entry_for(TpuSliceRequest(tpu="v6e-4"), id="g1", label="d.g1", team="g", arrival=1.0).to_json()
    within = rules.entry_for(TpuSliceRequest(tpu="v6e-4"), id="o1", label="d.o1", arrival=2.0).to_json()
    broker.heartbeat(greedy, {"quotas": {"g": {"v6e-4": 1_000_000}}, "policy": "best-effort"}, from_the_future=1)
    broker.heartbeat(within)
    broker.clock.now += queue.REPLAN_S
    state = broker.heartbeat(greedy, {"quotas": {"g": {"v6e-4": 1_000_000}}})
    assert broker.settings.quotas == {"g": {"v6e-4": 0}}
    # The one v6e-4 goes to the later step within its quota, not to the team over its quota that asked first.
    assert not state["admitted"] and broker.heartbeat(within)["admitted"]



def _round(broker, *entries, **suspended):
    """One beat from each launcher (a replan apart, so no place expires); the answers by id. `suspended`: what a
    launcher says it was told (by id)."""
    out = {}
    for e in entries:
        broker.clock.now += queue.REPLAN_S
        out[e["id"]] = broker.heartbeat(e, suspended=suspended.get(e["id"]))
    return out


def test_a_suspended_step_keeps_its_place_and_nobody_it_outranks_takes_its_slices(broker):
    """Issue 49 (1): V left the queue at its release and rejoined seconds later: meanwhile the broker admitted H
    and L onto its two slices, and V, back "first in line", waited for both (and could hit capacity_timeout).
    Its launcher now requeues the place in one call (`requeue`), and rejoins with the next attempt's request."""
    broker.set_settings({"preemption": "lower-priority"})
    v, h, low = _slices("v", n=2, preemptible=True), _slices("h", priority=10, at=2), _slices("l", at=3)
    assert _round(broker, v)["v"]["admitted"]
    _round(broker, v, h, low)
    assert "suspend" in _round(broker, v, h, low)["v"]
    away = {**v, "admitted": False, "rejoining": True}
    state = broker.requeue(away)  # at its release: back in line at its arrival (behind H only), still beating
    assert not state["admitted"] and state["rank"] == 2 and broker.suspending == {}
    for _ in range(3):  # the seconds its launcher spends between attempts: beats from everyone
        _round(broker, h, low, away)
    assert "h" in broker.running and "l" not in broker.running and "v" not in broker.running
    assert not broker.reasons["v"].startswith("first in line")  # it suspends nobody while it is away
    state = broker.requeue({**v, "admitted": False})  # the next attempt's request: first in line now
    assert not state["admitted"] and state["rank"] == 1
    broker.leave("h")
    answers = _round(broker, low, {**v, "admitted": False})
    assert answers["v"]["admitted"] and not _round(broker, low)["l"]["admitted"]


def test_an_elastic_step_alone_in_its_line_does_not_take_what_a_requeued_step_released(monkeypatch):
    broker = make_broker(monkeypatch, {"v6e-16": 3})
    v = _slices("v", n=2, preemptible=True)
    request = TpuSliceRequest(tpu="v6e-16", num_slices=(1, 3), multislice=True, elastic_wait=0)
    e = rules.entry_for(request, id="e", label="d.e", arrival=1001.0).to_json()
    assert _round(broker, v)["v"]["admitted"]
    assert _round(broker, v, e)["e"]["admitted"] and broker.entries["e"].amount == 1  # the one slice free
    broker.leave("e")  # it ended; V stops (a lost host) and requeues: a later elastic step asks, alone in line
    away = {**v, "admitted": False, "rejoining": True}
    broker.requeue(away)
    e2 = {**e, "id": "e2", "arrival": 1002.0}
    assert not _round(broker, away, e2)["e2"]["admitted"]  # not all three: V is ahead of it
    broker.clock.now += 2 * queue.PLAN_S
    assert broker.requeue({**v, "admitted": False})["admitted"]  # planned at once: admitted in the same call
    assert _round(broker, e2)["e2"]["admitted"] and broker.entries["e2"].amount == 1


def test_an_urgent_step_within_its_quota_preempts_behind_a_borrower_at_the_head_of_its_line(broker):
    """Issue 49 (5): `_choose_suspensions` looked at the line's first entry only, an over-quota borrower there,
    so the urgent request within its quota right behind it never suspended anyone."""
    broker.set_settings({"preemption": "lower-priority", "quotas": {"a": {"v6e-16": 16}}})
    a1 = rules.entry_for(TpuSliceRequest(tpu="v6e-16"), id="a1", label="d.a1", team="a", arrival=1.0).to_json()
    v = _slices("v", preemptible=True, at=2)
    a2 = rules.entry_for(TpuSliceRequest(tpu="v6e-16"), id="a2", label="d.a2", team="a", priority=10,
                         arrival=3.0).to_json()
    u = rules.entry_for(TpuSliceRequest(tpu="v6e-16"), id="u", label="d.u", team="u", priority=5,
                        arrival=4.0).to_json()
    assert all(s["admitted"] for s in _round(broker, a1, v).values())
    _round(broker, a1, v, a2, u)
    answers = _round(broker, a1, v, a2, u)
    assert answers["a2"]["reason"].startswith("team a over its quota")
    assert answers["u"]["reason"].startswith("first in line")
    assert _round(broker, v)["v"]["suspend"].startswith("suspended for d.u (priority 5")


def test_a_kind_an_autoscaler_adds_is_never_preempted_even_with_max_capacity_set(broker, monkeypatch):
    """Issue 49 (7): docs/sharing.md says kinds an autoscaler adds are never preempted, but a finite
    `max_capacity` made them preemptible (a running step there may still wait for its node: suspending
    it frees nothing)."""
    from rayslice.cluster import autoscaler

    monkeypatch.setattr(type(broker), "_capacity", REAL_CAPACITY)
    monkeypatch.setattr(queue.ray, "nodes", lambda: [])
    monkeypatch.setattr(autoscaler, "may_add", lambda resource: True)
    monkeypatch.setattr(queue, "group_maxima", lambda: {}, raising=False)
    broker.set_settings({"max_capacity": {"v6e-16": 1}, "preemption": "lower-priority"})
    v, h = _slices("v", preemptible=True), _slices("h", priority=10, at=1)
    assert _round(broker, v)["v"]["admitted"]
    for _ in range(2):
        answers = _round(broker, v, h)
    assert not answers["h"]["admitted"] and "suspend" not in answers["v"]


def test_a_broker_made_anew_remembers_which_step_is_being_suspended(broker):
    """Issue 49 (8): a broker restart forgot `suspending` and `told`; the new one chose victims afresh (by the
    launchers' admission clocks) and told a second step to suspend while the first was checkpointing."""
    broker.set_settings({"preemption": "lower-priority"})
    first, second, h = _slices("v1", preemptible=True), _slices("v2", preemptible=True, at=1), \
        _slices("h", priority=10, at=2)
    assert all(s["admitted"] for s in _round(broker, first, second).values())
    _round(broker, first, second, h)
    answers = _round(broker, first, second, h)
    told, other = (first, second) if "suspend" in answers["v1"] else (second, first)
    why = broker.suspending[told["id"]]
    assert "suspend" not in answers[other["id"]]
    fresh = type(broker)()  # made anew: every launcher re-registers with its entry, and what it heard
    fresh.clock = broker.clock
    # The launchers' clocks when they heard their admissions: now the other one reads as the younger.
    other = {**other, "admitted": True, "admitted_at": broker.clock.now + 50}
    told = {**told, "admitted": True, "admitted_at": broker.clock.now}
    for _ in range(int(queue.RECOVERY_S / queue.REPLAN_S) + 3):
        answers = _round(fresh, other, told, h, **{told["id"]: why})
    assert "suspend" not in answers[other["id"]] and answers[told["id"]]["suspend"] == why
    assert fresh.suspending == {told["id"]: why}


class _Handle:
    """The broker's actor handle, over the plain class: each call runs at once (one at a time), and the calls of
    one launcher's place (`watched`) are recorded as (method, id)."""

    def __init__(self, broker) -> None:
        import threading

        self.broker, self.lock, self.calls, self.watched = broker, threading.Lock(), [], None
        for name in ("heartbeat", "requeue", "leave"):
            setattr(self, name, self._method(name))

    def _method(self, name):
        import types

        def remote(*args, **kwargs):
            id = args[0] if name == "leave" else args[0]["id"]
            with self.lock:
                if self.watched is not None and id.startswith(self.watched):
                    self.calls.append((name, id))
                return getattr(self.broker, name)(*args, **kwargs)

        return types.SimpleNamespace(remote=remote)


def test_a_launcher_never_leaves_the_queue_between_a_suspended_attempt_and_its_resumption(broker, monkeypatch):
    """Issue 49 (1), at the launcher: `release()` left the queue, and only after the log drain, the checkpoint
    listings and the timeline did the next attempt join again. Every broker call of the step's place is
    recorded: no leave between the release and the next attempt's admission, and in that gap the urgent step
    is admitted at once while the later, lower-ranked one is not."""
    import types

    import rayslice.cluster as launcher
    from rayslice.cluster import reservation
    from rayslice.cluster.environments import HostPlan
    from rayslice.core.exceptions import SuspendedError
    from rayslice.core.step import StepSpec

    handle = _Handle(broker)
    handle.watched = "adhoc/"
    monkeypatch.setattr(queue, "broker", lambda: handle)
    monkeypatch.setattr(queue.ray, "get", lambda value, timeout=None: value)

    def run(place):  # its beats while it waits to be admitted, each a replan later; between attempts, the test's
        while not place._stop.wait(0.005):
            if not place.admitted.is_set() and not getattr(place.entry, "rejoining", False):
                with handle.lock:
                    broker.clock.now += queue.REPLAN_S
                place._beat()

    monkeypatch.setattr(queue.Place, "_run", run)
    broker.set_settings({"preemption": "lower-priority"})
    urgent, later = _slices("h", priority=10, at=5), _slices("l", at=6)
    seen = {}

    def reserve(request, timeout, name, lost_nodes, place):
        seen["place"] = place
        host = HostPlan(slice_index=0, slice_name="slice-a", worker_id=0, ip="10.0.0.1", process_id=0,
                        num_processes=1, coordinator="", megascale_coordinator="", node_id="n0")
        return reservation.SliceReservation(request=request, heads="heads", hosts=[host], bundles={(0, 0): 0},
                                            place=place)

    def run_gang(actors, plans, spec, attempt, timeline, watch):
        if attempt.preemption_attempt == 0:  # the urgent and the later step ask; the step is suspended
            for e in (urgent, later):
                handle.heartbeat.remote(e)
            error = SuspendedError("suspended by a preemption notice (suspended for d.h (priority 10)); stopped")
            error.node_id, error.slice_name, error.stopped_at_deadline = "", "", False
            raise error
        return ["done"]

    def between_attempts(actors):  # after the release: the other launchers beat for a while
        seen["calls at release"] = list(handle.calls)
        for _ in range(5):
            broker.clock.now += queue.REPLAN_S
            answers = {e["id"]: handle.heartbeat.remote(e) for e in (urgent, later)}
            seen["place"]._beat()
            # Said here, not after: once the later step holds a slice, the step would wait for it forever.
            assert not answers["l"]["admitted"], "a lower-ranked step took the suspended step's capacity"
        assert answers["h"]["admitted"]  # the urgent step at once
        handle.leave.remote("h")  # the urgent step ran and is done
        broker.clock.now += queue.REPLAN_S

    monkeypatch.setattr(launcher, "check_satisfiable", lambda *a, **k: set())
    monkeypatch.setattr(launcher, "reserve_slices", reserve)
    monkeypatch.setattr(reservation, "remove_placement_group", lambda group: None)
    monkeypatch.setattr(reservation, "_removed", lambda group: True)
    monkeypatch.setattr(launcher, "placement_group", lambda *a, **k: "marker")
    monkeypatch.setattr(launcher, "remove_placement_group", lambda group: None)
    monkeypatch.setattr(launcher.notices, "Watch", lambda key, nodes, requested=None, **kw: types.SimpleNamespace(
        key=key, notice=None, offer=None, noticed_at=None, __enter__=lambda: None, __exit__=lambda *a: None,
        heard=lambda: None, hosts_stopping=lambda: False))
    monkeypatch.setattr(launcher, "_hosts_runtime_env", lambda spec, *a, **k: launcher.HostsEnv(None, None))
    monkeypatch.setattr(launcher.host_process.HostProcess, "options",
                        lambda **kw: types.SimpleNamespace(remote=lambda *a: "actor"), raising=False)
    monkeypatch.setattr(launcher.gang, "await_started", lambda actors, hosts, timeout, watch=None: [1234])
    monkeypatch.setattr(launcher.gang, "run_gang", run_gang)
    monkeypatch.setattr(launcher.gang, "kill", lambda actors: None)
    monkeypatch.setattr(launcher.log_drain, "LogDrain", type("Drain", (), {
        "QUIET_S": 0.0, "wait": lambda self, *a, **k: None, "close": lambda self: None,
        "explain_shutdown": lambda self, *a: None}))
    monkeypatch.setattr(launcher, "_wait_for_hosts_to_end", between_attempts)
    monkeypatch.setattr(launcher.metrics.sender, "attempt", lambda *a, **k: None)
    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16", num_slices=2), callable="t:f", preemptible=True,
                    preemption_retries=1, capacity_timeout=60)
    waits = launcher.Waits(capacity=60, start=60, arrival=broker.clock.now)  # it asked before the other two
    assert launcher._attempts(spec, launcher.phases.Timeline(), None, waits, [], None) == ["done"]
    methods = [name for name, _ in handle.calls]
    assert "leave" not in [name for name, _ in seen["calls at release"]], seen["calls at release"]
    assert methods.count("requeue") == 2 and "leave" not in methods[:max(i for i, m in enumerate(methods)
                                                                          if m == "requeue")], methods
    assert len({id for _, id in handle.calls}) == 1  # one place for both attempts


def test_a_requeue_with_a_broker_from_before_it_leaves_and_registers_again(broker, monkeypatch):
    """A detached broker started by an older rayslice has no `requeue`: the place must still come back (at its
    arrival) rather than beat a call that can never succeed and expire."""
    handle = _Handle(broker)
    handle.watched = "v"
    del handle.requeue
    monkeypatch.setattr(queue, "broker", lambda: handle)
    monkeypatch.setattr(queue.ray, "get", lambda value, timeout=None: value)
    monkeypatch.setattr(queue.Place, "_run", lambda place: None)
    place = queue.Place(rules.Entry.from_json(_slices("v", n=2)))
    assert place.join().admitted.is_set()
    place.requeue()
    assert [name for name, _ in handle.calls] == ["heartbeat", "leave", "heartbeat"]
    assert not broker.entries["v"].admitted and broker.entries["v"].arrival == 1000.0
    assert not place.admitted.is_set() and not place._requeue


def test_an_urgent_elastic_step_preempts_when_only_a_slice_missing_a_host_is_free(monkeypatch):
    """Elastic grants count only intact slices, but the choice of victims counted every slice with a worker 0:
    with the one free slice missing a host, an urgent elastic (1, 2) step was "first in line" yet the broker
    saw room for it and suspended nobody, so it waited for a natural release."""
    broker = make_broker(monkeypatch, {"v6e-16": 3})
    broker._intact = {"v6e-16": 2}  # slice c lost worker 2; its worker 0 lives
    broker.set_settings({"preemption": "lower-priority"})
    v, fixed = _slices("v", preemptible=True), _slices("f", at=1)
    request = TpuSliceRequest(tpu="v6e-16", num_slices=(1, 2), multislice=True, elastic_wait=0)
    urgent = rules.entry_for(request, id="e", label="d.e", priority=10, arrival=1002.0).to_json()
    assert all(s["admitted"] for s in _round(broker, v, fixed).values())
    for _ in range(2):
        answers = _round(broker, v, fixed, urgent)
    assert not answers["e"]["admitted"] and answers["e"]["reason"].startswith("first in line")
    assert _round(broker, v)["v"]["suspend"].startswith("suspended for d.e (priority 10")


def test_a_step_that_never_comes_back_from_between_attempts_holds_its_line_only_so_long(broker):
    """A requeued step's launcher that stays alive but never rejoins (stuck listing a huge checkpoint folder, a
    hung driver) kept beating `rejoining`, and its line stopped at it forever: nobody behind it was admitted,
    though it held nothing. After `REJOIN_S` the line passes it; it keeps its arrival for when it comes back."""
    v, low = _slices("v", n=2, preemptible=True), _slices("l", at=3)
    assert _round(broker, v)["v"]["admitted"]
    away = {**v, "admitted": False, "rejoining": True}
    broker.requeue(away)
    started = broker.clock.now
    while broker.clock.now - started < queue.REJOIN_S - 2 * queue.REPLAN_S:
        assert not _round(broker, away, low)["l"]["admitted"]  # the seconds a resuming step needs: kept
    for _ in range(4):
        answers = _round(broker, away, low)
    assert answers["l"]["admitted"] and not answers["v"]["admitted"]
    assert broker.requeue({**v, "admitted": False})["rank"] == 1  # back: first in line at its arrival
