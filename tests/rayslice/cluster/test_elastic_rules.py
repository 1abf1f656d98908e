"""Elastic slice counts without a cluster: the broker's offers to grow (taken back, expiring, only onto whole
slices), the gang after an offer, a bound on suspensions to grow, and the notice that replaces an offer."""

from __future__ import annotations

import time
import types

import pytest

from rayslice.cluster import gang, host_loss, host_process, notices, queue
from rayslice.cluster.environments import HostPlan
from rayslice.core import queue as rules
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.context import PreemptionNotice
from rayslice.core.exceptions import StepFailedError, StepSuspended, SuspendedError
from rayslice.core.step import StepSpec
from tests.rayslice.cluster.test_broker_rules import make_broker
from tests.rayslice.cluster.test_notice_rules import FakeRay, _actor

REAL_CAPACITY = queue.Broker.__ray_actor_class__._capacity


class AdmittedPlace:
    """A queue place admitted at once (the launcher's side of `rayslice.cluster.queue.Place`)."""

    def __init__(self, entry):
        self.entry = entry
        self.suspend = self.grow = None

    def join(self):
        self.admitted = types.SimpleNamespace(is_set=lambda: True)
        return self

    def wait(self, timeout):
        return 0.0

    def leave(self):
        pass


def _stopped_to_grow() -> SuspendedError:
    """What the gang raises when an elastic step stopped for an offer to grow."""
    error = SuspendedError("suspended by a preemption notice (1 more v6e-16 free); the step stopped for it")
    error.node_id, error.slice_name, error.stopped_at_deadline = "", "", False
    error.grow = True
    return error


def _launcher_without_a_cluster(monkeypatch, place_for, reserve_and_run) -> None:
    """`rayslice.cluster._attempts` with the queue's place and each attempt's run given by the test."""
    import rayslice.cluster as launcher

    monkeypatch.setattr(launcher, "check_satisfiable", lambda *a, **k: set())
    monkeypatch.setattr(launcher.admission, "place_for", place_for)
    monkeypatch.setattr(launcher, "_reserve_and_run_on_slices", reserve_and_run)
    monkeypatch.setattr(launcher.metrics.sender, "attempt", lambda *a, **k: None)


@pytest.fixture
def broker(monkeypatch):
    """The broker's plain class, as tests/rayslice/cluster/test_broker_rules.py drives it: 4 x v6e-16."""
    return make_broker(monkeypatch, {"v6e-16": 4})


def _fixed(id, slices, at):
    return rules.entry_for(TpuSliceRequest(tpu="v6e-16", num_slices=slices), id=id, label=f"d.{id}",
                           arrival=at).to_json()


def _elastic(id, low, high, at):
    request = TpuSliceRequest(tpu="v6e-16", num_slices=(low, high), multislice=True, elastic_wait=0)
    return rules.entry_for(request, id=id, label=f"d.{id}", arrival=at).to_json()


def _beat(broker, entry):
    broker.clock.now += queue.REPLAN_S
    return broker.heartbeat(entry)


def test_an_offer_heard_is_taken_back_when_the_free_slices_are_taken(broker):
    """An elastic step on 1 of (1, 3) hears it may grow by 2; then a 3-slice step is admitted onto those slices.
    The broker keeps answering "grow" (and the launcher's notice stays): a step acting on it suspends into a
    queue with nothing free for it, and waits (up to capacity_timeout) or comes back on fewer."""
    t0 = broker.clock.now
    busy = _fixed("busy", 3, t0)
    assert _beat(broker, busy)["admitted"]
    e = _elastic("e", 1, 3, t0 + 1)
    assert _beat(broker, e)["admitted"] and broker.entries["e"].amount == 1
    broker.leave("busy")
    assert _beat(broker, e).get("grow")  # heard: 3 free
    later = _fixed("later", 3, t0 + 2)
    assert _beat(broker, later)["admitted"]  # the 3 free slices are taken
    state = _beat(broker, e)
    assert not state.get("grow"), state


def test_an_ignored_offer_does_not_keep_another_elastic_step_from_growing_forever(broker):
    """docs/elastic.md: a step may ignore the offer. The told offer counts its whole max as taken for good:
    a second elastic step is never offered the slices that sit free (an hour later, still none)."""
    t0 = broker.clock.now
    busy = _fixed("busy", 2, t0)
    assert _beat(broker, busy)["admitted"]
    e = _elastic("e", 1, 3, t0 + 1)
    f = _elastic("f", 1, 2, t0 + 2)
    broker.heartbeat(e)  # both arrive before the next plan: e asks for its least, f takes the one left
    assert _beat(broker, f)["admitted"] and _beat(broker, e)["admitted"]
    assert (broker.entries["e"].amount, broker.entries["f"].amount) == (1, 1)
    broker.leave("busy")
    assert _beat(broker, e).get("grow")  # e hears it may take 2 more; it carries on on 1
    broker.clock.now += 3600
    for _ in range(3):
        _beat(broker, e)
        state = _beat(broker, f)
    # 2 slices have sat free for an hour, e ignores its offer, and f (on 1 of its 2) never hears one
    assert state.get("grow"), (state, broker.growing)


# ---- the gang after an offer to grow

def _grow_watch():
    watch = notices.Watch("k", {"node0": "v6e-16-a/host0"})
    watch.publish(PreemptionNotice(deadline=time.time() + notices.GROW_DEADLINE_S,
                                   reason="1 more v6e-16 free and nobody waits for it", grow=True))
    return watch


def test_a_real_error_after_an_offer_to_grow_is_a_failure_not_a_free_resumption(monkeypatch, kv):
    """The step ignores the offer (allowed) and then fails with a bug. run_gang turns any end after a notice into
    a SuspendedError, and `_reserve_and_run_on_slices` marks every SuspendedError under a grow notice `grow`:
    the bug is retried with no preemption retry used (a step that keeps failing after offers never stops)."""
    monkeypatch.setattr(gang, "ray", fake := FakeRay())
    monkeypatch.setattr(host_loss, "ray", fake)
    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), callable="train:fit", hang_timeout=None,
                    preemption_retries=0)
    plans = [HostPlan(slice_index=0, slice_name="v6e-16-a", worker_id=0, ip="10.0.0.0", process_id=0,
                      num_processes=1, coordinator="", megascale_coordinator="", node_id="node0")]
    with pytest.raises(StepFailedError) as info:
        gang.run_gang([_actor(ZeroDivisionError("the real bug"))], plans, spec, host_process.Attempt(), None,
                      _grow_watch())
    assert not isinstance(info.value, SuspendedError), info.value


def test_a_drain_after_an_old_offer_to_grow_still_leaves_the_minimum_grace(kv):
    """`stop_at` counts MIN_GRACE_S from the first notice heard. An offer to grow heard an hour ago, then a drain
    whose deadline reads as past (a drainer's clock ahead): the step is stopped at once, with no grace."""
    watch = _grow_watch()
    watch.noticed_at -= 3600  # the offer came an hour ago; the step carried on
    heard = time.time()
    watch.publish(PreemptionNotice(deadline=heard - 10, reason="node0 is being drained", node="node0"))
    assert watch.notice.node == "node0" and not watch.notice.grow
    assert watch.stop_at() >= heard + notices.MIN_GRACE_S - 0.5


def test_suspensions_to_grow_are_bounded_and_do_not_retry_forever_for_free(monkeypatch):
    """Every SuspendedError marked `grow` skips the retry count, with no bound: offers that are never withdrawn
    (test above) or a bug after an offer (test above) loop the step forever. `deferral_limit` itself assumes at
    most `max - min` extra attempts; a (1, 2) step with preemption_retries=0 here ran 20 attempts."""
    import rayslice.cluster as launcher

    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16", num_slices=(1, 2), multislice=True), callable="t:f",
                    preemption_retries=0, capacity_timeout=60)
    runs = []

    def reserve_and_run(spec, request, attempt, timeline, waits, name, started, place):
        runs.append(request.num_slices)
        if len(runs) >= 20:
            return ["gave up looping"]
        raise _stopped_to_grow()

    _launcher_without_a_cluster(monkeypatch, lambda *a, **k: AdmittedPlace(
        types.SimpleNamespace(part=False, preemptible=False, amount=1)), reserve_and_run)
    with pytest.raises(SuspendedError):
        launcher._attempts(spec, launcher.phases.Timeline(), None, launcher.Waits(capacity=60, start=60), [], None)
    assert len(runs) <= 2, runs


def test_a_hosts_listener_hears_the_drain_that_replaces_an_offer_to_grow(monkeypatch):
    """`HostListener` reads the notice key once and stops: the driver's Watch replaces an offer to grow with a
    priority or drain notice (same key), but no host ever reads the replacement."""
    store: dict[str, bytes] = {}
    monkeypatch.setattr(notices.internal_kv, "_internal_kv_get", lambda k, namespace=None, **kw: store.get(k))
    heard: list[PreemptionNotice] = []
    grow = PreemptionNotice(deadline=time.time() + notices.GROW_DEADLINE_S, reason="1 more free", grow=True)
    store["k"] = grow.to_json()
    with notices.HostListener("k", heard.append, poll=0.01):
        deadline = time.time() + 2
        while not heard and time.time() < deadline:
            time.sleep(0.01)
        store["k"] = PreemptionNotice(deadline=time.time() + 30, reason="node0 drained", node="node0").to_json()
        deadline = time.time() + 1
        while len(heard) < 2 and time.time() < deadline:
            time.sleep(0.01)
    assert [n.grow for n in heard] == [True, False], heard


def test_no_offer_to_grow_onto_a_slice_that_has_lost_hosts(broker, monkeypatch):
    """The broker counts a slice by its worker-0 host (`_capacity`): a v6e-16 whose workers 1-3 are gone still
    reads as a free slice. An elastic step on 1 of (1, 2) is offered it, stops, is admitted on 2, and then waits
    in `reserve_slices` for hosts that are not coming (its whole capacity_timeout), after giving up a working run."""
    from rayslice.cluster import autoscaler, reservation

    Broker = queue.Broker.__ray_actor_class__
    monkeypatch.setattr(Broker, "_capacity", REAL_CAPACITY)
    nodes = [{"NodeID": f"{s}{w}", "Alive": s == "a" or w == 0, "Resources": {"TPU": 4.0},
              "Labels": {queue.POD_TYPE_LABEL: "v6e-16", queue.WORKER_ID_LABEL: str(w),
                         reservation.SLICE_NAME_LABEL: f"slice-{s}"}}
             for s in "ab" for w in range(4)]
    monkeypatch.setattr(queue.ray, "nodes", lambda: nodes)
    monkeypatch.setattr(queue, "group_maxima", lambda: {})
    monkeypatch.setattr(autoscaler, "may_add", lambda resource: False)
    assert reservation.intact_slices(TpuSliceRequest(tpu="v6e-16"), nodes) == 1
    e = _elastic("e", 1, 2, broker.clock.now)
    busy = _fixed("busy", 1, broker.clock.now - 1)
    # e first: it is granted only the intact slice (issue 49 (2)); busy is counted on the broken one, and
    # waits for Ray there, as a fixed request does.
    assert _beat(broker, e)["admitted"] and broker.entries["e"].amount == 1
    assert _beat(broker, busy)["admitted"]
    broker.leave("busy")
    broker.clock.now += 1000  # past TOTALS_TTL_S
    state = _beat(broker, e)
    assert not state.get("grow"), state


def _round(broker, *entries):
    """One heartbeat from each launcher, a replan apart; the last one's answer for each."""
    out = {}
    for entry in entries:
        broker.clock.now += queue.REPLAN_S
        out[entry["id"]] = broker.heartbeat(entry)
    return out


def test_an_offer_heard_is_not_taken_back_for_a_step_that_may_not_be_offered(broker, monkeypatch):
    """A (admitted first) let its offer lapse: it is not offered again for GROW_OFFER_S. B is offered the free
    slices instead and hears it. Nothing changed since, nobody waits: B's offer must stand. `_offer_growth`
    checks kept offers against `rules.growth` over *all* running steps, so A (who may not be offered) absorbs
    the free slices there and B's heard offer is taken back at every plan and made afresh in the same plan (a new
    `at`): B's offer never lapses and B is never waited out, whatever it ignores."""
    monkeypatch.setattr(queue, "GROW_OFFER_S", 30 * queue.REPLAN_S)
    t0 = broker.clock.now
    busy, other = _fixed("busy", 3, t0), _fixed("other", 2, t0 + 1)
    a, b = _elastic("a", 1, 3, t0 + 2), _elastic("b", 1, 3, t0 + 3)
    _round(broker, busy, a)
    broker.leave("busy")
    _round(broker, other, b)
    assert broker.entries["a"].amount == 1 and broker.entries["b"].amount == 1, broker.entries
    broker.leave("other")
    assert _round(broker, a, b)["a"].get("grow")  # A (earliest) is offered the 2 free
    for _ in range(20):  # A ignores it until it lapses
        _round(broker, a, b)
        if "a" in broker.no_offer_until:
            break
    assert "a" in broker.no_offer_until
    heard = [bool(_round(broker, a, b)["b"].get("grow")) for _ in range(6)]  # 12 s: A still waits out
    assert any(heard), heard
    first = heard.index(True)
    assert all(heard[first:]), f"B's offer flaps between made and taken back: {heard}"
    made = broker.growing["b"].at
    for _ in range(3):
        _round(broker, a, b)
    # B heard its offer and nothing changed: it is the same offer, and it lapses GROW_OFFER_S after it was made.
    # Instead every plan takes it back (A, who may not be offered, absorbs the free slices in `still`) and makes
    # it afresh with a new `at`: an ignored offer to B never lapses, and B is never waited out.
    assert broker.growing["b"].at == made, (made, broker.growing["b"])


def test_a_step_that_stopped_for_an_offer_taken_back_meanwhile_is_not_failed(monkeypatch, kv):
    """The step hears an offer to grow, checkpoints, and raises StepSuspended (as docs/elastic.md says). While it
    checkpoints, a request of that type starts waiting: the broker takes the heard offer back, the Watch drops its
    notice (`_withdraw_offer`). run_gang then finds no notice and the StepSuspended is a plain step failure: the
    task fails after a clean checkpoint-and-stop the launcher itself asked for."""
    monkeypatch.setattr(gang, "ray", fake := FakeRay())
    monkeypatch.setattr(host_loss, "ray", fake)
    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), callable="train:fit", hang_timeout=None,
                    preemption_retries=0)
    plans = [HostPlan(slice_index=0, slice_name="v6e-16-a", worker_id=0, ip="10.0.0.0", process_id=0,
                      num_processes=1, coordinator="", megascale_coordinator="", node_id="node0")]
    watch = notices.Watch("k", {"node0": "v6e-16-a/host0"})
    watch.publish(PreemptionNotice(deadline=time.time() + notices.GROW_DEADLINE_S,
                                   reason="1 more v6e-16 free and nobody waits for it", grow=True))
    watch._withdraw_offer()  # the broker took it back while the hosts were checkpointing
    try:
        gang.run_gang([_actor(StepSuspended("checkpointed at step 1200"))], plans, spec, host_process.Attempt(), None,
                      watch)
    except SuspendedError:
        pass  # resumed from its checkpoint: fine
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"a step that stopped for the launcher's own offer failed: {type(exc).__name__}: {exc}")


def test_offers_stop_once_the_suspensions_to_grow_are_used_up(monkeypatch):
    """`_attempts` allows `max - min` suspensions to grow for free; after that an accepted offer counts as a
    preemption (with preemption_retries=0: the task fails). But the next attempt's place is still offered growth
    (`entry.grows` stays True, the Watch still relays it): the launcher offers, the step accepts as documented,
    and the launcher fails it for accepting. Once no grow is left, the place must not be offered more."""
    import rayslice.cluster as launcher

    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16", num_slices=(1, 2), multislice=True), callable="t:f",
                    preemption_retries=0, capacity_timeout=60)
    grows: list[bool] = []
    real_place_for = launcher.admission.place_for

    def place_for(*a, **k):
        entry = real_place_for(*a, **k).entry
        grows.append(entry.grows)
        return AdmittedPlace(entry)

    def reserve_and_run(spec, request, attempt, timeline, waits, name, started, place):
        if len(grows) >= 2:
            return ["done"]
        raise _stopped_to_grow()

    _launcher_without_a_cluster(monkeypatch, place_for, reserve_and_run)
    launcher._attempts(spec, launcher.phases.Timeline(), None, launcher.Waits(capacity=60, start=60), [], None)
    assert grows == [True, False], f"offers to grow after the one free grow was used: {grows}"


def test_an_elastic_step_is_admitted_only_on_slices_with_every_host(broker, monkeypatch):
    """Issue 49 (2): the broker counts a slice while its worker 0 lives, and only offers to grow used the intact
    count. A (1, 3) step (fresh, or back after stopping to grow) was admitted on 3 slices when one had lost its
    worker 2: `reserve_slices` avoids that slice, so it waited its whole capacity_timeout and failed the try,
    while the queue counted 3 slices as held."""
    from rayslice.cluster import autoscaler, reservation

    Broker = queue.Broker.__ray_actor_class__
    monkeypatch.setattr(Broker, "_capacity", REAL_CAPACITY)
    nodes = [{"NodeID": f"{s}{w}", "Alive": not (s == "c" and w == 2), "Resources": {"TPU": 4.0},
              "Labels": {queue.POD_TYPE_LABEL: "v6e-16", queue.WORKER_ID_LABEL: str(w),
                         reservation.SLICE_NAME_LABEL: f"slice-{s}"}}
             for s in "abc" for w in range(4)]
    monkeypatch.setattr(queue.ray, "nodes", lambda: nodes)
    monkeypatch.setattr(queue, "group_maxima", lambda: {})
    monkeypatch.setattr(autoscaler, "may_add", lambda resource: False)
    assert reservation.intact_slices(TpuSliceRequest(tpu="v6e-16"), nodes) == 2
    assert _beat(broker, _elastic("e", 1, 3, broker.clock.now))["admitted"]
    assert broker.entries["e"].amount == 2


def test_a_step_that_stopped_to_grow_comes_back_on_at_least_what_it_had(broker):
    """Issue 49 (1): a step that stopped for an offer left the queue before it rejoined; a later one-slice step
    took one of its slices meanwhile, and it came back waiting for slices it had held (docs/elastic.md: never
    fewer than it had). It requeues at its release, and rejoins asking for at least what it had."""
    g = _elastic("g", 1, 4, broker.clock.now)
    busy = _fixed("busy", 2, broker.clock.now - 1)
    assert _beat(broker, busy)["admitted"] and _beat(broker, g)["admitted"] and broker.entries["g"].amount == 2
    broker.leave("busy")
    assert _round(broker, g)["g"].get("grow")  # two more free: it checkpoints and stops to take them
    broker.requeue({**g, "amount": 2.0, "admitted": False, "rejoining": True})  # at its release
    later = _fixed("later", 1, broker.clock.now)
    away = {**g, "admitted": False, "rejoining": True}
    assert not _round(broker, later, away, later)["later"]["admitted"]
    back = rules.entry_for(TpuSliceRequest(tpu="v6e-16", num_slices=(1, 4), multislice=True, elastic_wait=0),
                           id="g", label="d.g", arrival=g["arrival"], least_slices=2).to_json()
    broker.clock.now += queue.REPLAN_S
    assert broker.requeue(back)["admitted"] and broker.entries["g"].amount >= 2
