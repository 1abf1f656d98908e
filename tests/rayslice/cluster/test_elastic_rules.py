"""Elastic slice counts without a cluster: the broker's offers to grow (taken back, expiring, only onto whole
slices), the gang after an offer, a bound on suspensions to grow, and the notice that replaces an offer."""

from __future__ import annotations

import time
import types

import pytest
from ray.exceptions import RayTaskError

from rayslice.cluster import gang, notices, queue
from rayslice.cluster.environments import HostPlan
from rayslice.core import queue as rules
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.context import PreemptionNotice
from rayslice.core.exceptions import StepFailedError, SuspendedError
from rayslice.core.step import StepSpec

REAL_CAPACITY = queue.Broker.__ray_actor_class__._capacity


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def broker(monkeypatch):
    """The broker's plain class, as tests/rayslice/cluster/test_broker_rules.py drives it: 4 x v6e-16."""
    kv: dict[str, bytes] = {}
    clock = Clock()
    monkeypatch.setattr(queue, "_kv_get", kv.get, raising=False)
    monkeypatch.setattr(queue, "_kv_put", kv.__setitem__, raising=False)
    monkeypatch.setattr(queue.time, "monotonic", clock)
    monkeypatch.setattr(queue.time, "time", clock)
    monkeypatch.setattr(queue.ray, "get_runtime_context",
                        lambda: type("Context", (), {"was_current_actor_reconstructed": False})())
    Broker = queue.Broker.__ray_actor_class__
    monkeypatch.setattr(Broker, "_capacity", lambda self, kinds: ({"v6e-16": 4}, set(), {}))
    monkeypatch.setattr(Broker, "_send_probe", lambda self, at: self.caught_up_to(at), raising=False)
    b = Broker()
    b.clock = clock
    return b


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

class FakeRay:
    def wait(self, pending, num_returns=1, timeout=None):
        return list(pending)[:num_returns], list(pending)[num_returns:]

    def get(self, ref):
        if isinstance(ref.outcome, BaseException):
            raise RayTaskError("run", "Traceback: ...", ref.outcome)
        return ref.outcome, {}

    def kill(self, actor, no_restart=True):
        pass


class Ref:
    def __init__(self, outcome) -> None:
        self.outcome = outcome


def _actor(outcome):
    ref = Ref(outcome)
    return types.SimpleNamespace(run=types.SimpleNamespace(remote=lambda *a: ref))


@pytest.fixture
def kv(monkeypatch):
    store: dict[str, bytes] = {}
    monkeypatch.setattr(notices.internal_kv, "_internal_kv_put",
                        lambda k, v, namespace=None, **kw: store.__setitem__(k, v))
    monkeypatch.setattr(notices.internal_kv, "_internal_kv_del", lambda k, namespace=None, **kw: store.pop(k, None))
    return store


def _grow_watch():
    watch = notices.Watch("k", {"node0": "v6e-16-a/host0"})
    watch.publish(PreemptionNotice(deadline=time.time() + notices.GROW_DEADLINE_S,
                                   reason="1 more v6e-16 free and nobody waits for it", grow=True))
    return watch


def test_a_real_error_after_an_offer_to_grow_is_a_failure_not_a_free_resumption(monkeypatch, kv):
    """The step ignores the offer (allowed) and then fails with a bug. run_gang turns any end after a notice into
    a SuspendedError, and `_reserve_and_run_on_slices` marks every SuspendedError under a grow notice `grow`:
    the bug is retried with no preemption retry used (a step that keeps failing after offers never stops)."""
    monkeypatch.setattr(gang, "ray", FakeRay())
    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), callable="train:fit", hang_timeout=None,
                    preemption_retries=0)
    plans = [HostPlan(slice_index=0, slice_name="v6e-16-a", worker_id=0, ip="10.0.0.0", process_id=0,
                      num_processes=1, coordinator="", megascale_coordinator="", node_id="node0")]
    with pytest.raises(StepFailedError) as info:
        gang.run_gang([_actor(ZeroDivisionError("the real bug"))], plans, spec, gang.Attempt(), None, _grow_watch())
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

    class Place:
        def __init__(self, *a, **k):
            self.entry = types.SimpleNamespace(part=False, preemptible=False, amount=1)
            self.suspend = self.grow = None

        def join(self):
            self.admitted = types.SimpleNamespace(is_set=lambda: True)
            return self

        def wait(self, timeout):
            return 0.0

        def leave(self):
            pass

    def reserve_and_run(spec, request, attempt, timeline, waits, name, started, place):
        runs.append(request.num_slices)
        if len(runs) >= 20:
            return ["gave up looping"]
        error = SuspendedError("suspended by a preemption notice (1 more v6e-16 free); the step stopped for it")
        error.node_id, error.slice_name, error.stopped_at_deadline = "", "", False
        error.grow = True
        raise error

    monkeypatch.setattr(launcher, "check_satisfiable", lambda *a, **k: set())
    monkeypatch.setattr(launcher.admission, "place_for", lambda *a, **k: Place())
    monkeypatch.setattr(launcher, "_reserve_and_run_on_slices", reserve_and_run)
    monkeypatch.setattr(launcher.metrics.sender, "attempt", lambda *a, **k: None)
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
    from rayslice.cluster import reservation

    Broker = queue.Broker.__ray_actor_class__
    monkeypatch.setattr(Broker, "_capacity", REAL_CAPACITY)
    nodes = [{"NodeID": f"{s}{w}", "Alive": s == "a" or w == 0, "Resources": {"TPU": 4.0},
              "Labels": {queue.POD_TYPE_LABEL: "v6e-16", queue.WORKER_ID_LABEL: str(w),
                         reservation.SLICE_NAME_LABEL: f"slice-{s}"}}
             for s in "ab" for w in range(4)]
    monkeypatch.setattr(queue.ray, "nodes", lambda: nodes)
    monkeypatch.setattr(queue, "group_maxima", lambda: {})
    monkeypatch.setattr(reservation, "_autoscaler_may_add", lambda resource: False)
    assert reservation.intact_slices(TpuSliceRequest(tpu="v6e-16"), nodes) == 1
    e = _elastic("e", 1, 2, broker.clock.now)
    busy = _fixed("busy", 1, broker.clock.now - 1)
    assert _beat(broker, busy)["admitted"]
    assert _beat(broker, e)["admitted"] and broker.entries["e"].amount == 1
    broker.leave("busy")
    broker.clock.now += 1000  # past TOTALS_TTL_S
    state = _beat(broker, e)
    assert not state.get("grow"), state
