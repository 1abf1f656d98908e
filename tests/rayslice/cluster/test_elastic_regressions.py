"""Regressions found reviewing the Issue 40 review fixes (cluster-free)."""

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
from rayslice.core.exceptions import StepSuspended, SuspendedError
from rayslice.core.step import StepSpec


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def broker(monkeypatch):
    """The broker's plain class, as tests/rayslice/cluster/test_elastic_rules.py drives it: 4 x v6e-16."""
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


# ---- the gang when an offer is taken back while the step acts on it

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


def test_a_step_that_stopped_for_an_offer_taken_back_meanwhile_is_not_failed(monkeypatch, kv):
    """The step hears an offer to grow, checkpoints, and raises StepSuspended (as docs/elastic.md says). While it
    checkpoints, a request of that type starts waiting: the broker takes the heard offer back, the Watch drops its
    notice (`_withdraw_offer`). run_gang then finds no notice and the StepSuspended is a plain step failure: the
    task fails after a clean checkpoint-and-stop the launcher itself asked for."""
    monkeypatch.setattr(gang, "ray", FakeRay())
    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), callable="train:fit", hang_timeout=None,
                    preemption_retries=0)
    plans = [HostPlan(slice_index=0, slice_name="v6e-16-a", worker_id=0, ip="10.0.0.0", process_id=0,
                      num_processes=1, coordinator="", megascale_coordinator="", node_id="node0")]
    watch = notices.Watch("k", {"node0": "v6e-16-a/host0"})
    watch.publish(PreemptionNotice(deadline=time.time() + notices.GROW_DEADLINE_S,
                                   reason="1 more v6e-16 free and nobody waits for it", grow=True))
    watch._withdraw_offer()  # the broker took it back while the hosts were checkpointing
    try:
        gang.run_gang([_actor(StepSuspended("checkpointed at step 1200"))], plans, spec, gang.Attempt(), None,
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

    class Place:
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

    def place_for(*a, **k):
        entry = real_place_for(*a, **k).entry
        grows.append(entry.grows)
        return Place(entry)

    def reserve_and_run(spec, request, attempt, timeline, waits, name, started, place):
        if len(grows) >= 2:
            return ["done"]
        error = SuspendedError("suspended by a preemption notice (1 more v6e-16 free); the step stopped for it")
        error.node_id, error.slice_name, error.stopped_at_deadline = "", "", False
        error.grow = True
        raise error

    monkeypatch.setattr(launcher, "check_satisfiable", lambda *a, **k: set())
    monkeypatch.setattr(launcher.admission, "place_for", place_for)
    monkeypatch.setattr(launcher, "_reserve_and_run_on_slices", reserve_and_run)
    monkeypatch.setattr(launcher.metrics.sender, "attempt", lambda *a, **k: None)
    launcher._attempts(spec, launcher.phases.Timeline(), None, launcher.Waits(capacity=60, start=60), [], None)
    assert grows == [True, False], f"offers to grow after the one free grow was used: {grows}"
