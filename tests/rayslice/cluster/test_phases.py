"""The phase lines a step's job log ends with: one readable summary, one machine-readable record."""

from __future__ import annotations

import json
import types

import pytest

from rayslice import StepSuspended
from rayslice.client.submission import LogFollower
from rayslice.cluster import phases
from rayslice.cluster.phases import Timeline, parse_phases


def test_one_summary_line_and_the_full_record_for_benchmarks():
    timeline = Timeline()
    for offset, phase in enumerate(["accepted", "driver_started", "reserved", "released"]):
        timeline.mark(phase, at=100.0 + offset * 0.5)
    timeline.hosts([{"hosts_started": 101.2}])  # one host: its phases become the gang's
    summary, record = timeline.lines()
    assert summary == ("[rayslice] timeline: job accepted by Ray, driver process started +0.50 s, capacity "
                       "reserved +0.50 s, every host process started +0.20 s, capacity released +0.30 s "
                       "(1.50 s in all)")
    [parsed] = parse_phases(record)
    assert parsed["reserved"] == 101.0 and parsed["hosts"] == [{"hosts_started": 101.2}]


def test_the_task_log_gets_the_summary_not_every_hosts_timestamps():
    timeline = Timeline()
    timeline.mark("accepted", at=1.0)
    timeline.mark("released", at=2.0)
    relayed: list[str] = []
    LogFollower(relayed.append).feed("\n".join(["step output", *timeline.lines(), ""]))
    assert relayed == ["step output", "[rayslice] timeline: job accepted by Ray, capacity released +1.00 s "
                                      "(1.00 s in all)"]


def test_the_steps_reported_spans_chips_and_outcome_go_into_the_record_not_the_hosts_times():
    from rayslice.core.goodput import attempt_account

    timeline = Timeline()
    timeline.mark("reserved", at=10.0)
    timeline.chips, timeline.outcome = 8, "succeeded"
    timeline.hosts([{"step_started": 11.0, "step_done": 20.0, "spans": {"checkpointing": [[12.0, 13.0]]}},
                    {"step_started": 11.5, "step_done": 19.0, "spans": {"checkpointing": [[12.5, 13.5]]}}])
    timeline.mark("released", at=21.0)
    [parsed] = parse_phases(timeline.lines()[1])
    assert all("spans" not in host for host in parsed["hosts"])
    assert parsed["chips"] == 8 and parsed["outcome"] == "succeeded"
    assert parsed["spans"] == {"checkpointing": [[12.0, 13.0], [12.5, 13.5]]}
    account = attempt_account(parsed)
    assert account.seconds["checkpointing"] == 1.5 and account.held_chip_s == 88.0


def test_the_task_log_gets_the_goodput_summary_not_its_record():
    from rayslice.core.goodput import record_line, step_account

    account = step_account([{"reserved": 0.0, "step_started": 1.0, "step_done": 3.0, "released": 4.0, "chips": 4}])
    relayed: list[str] = []
    LogFollower(relayed.append).feed("\n".join([account.summary(), record_line(account), ""]))
    assert relayed == [account.summary()]
    assert relayed[0].startswith("[rayslice] goodput: 50.0% of 0.004444 chip-h held: startup 1.00 s (25.0%)")

def test_a_suspension_is_counted_apart_from_running_time_in_both_attempts_lines():
    from rayslice.cluster.suspend import Suspension

    suspended = phases.Timeline()
    for phase, at in (("reserved", 100.0), ("step_started", 110.0), ("released", 140.0)):
        suspended.mark(phase, at)
    suspended.note("notice", 125.0)
    line, record = suspended.lines()
    assert "15.00 s from the notice to the capacity released" in line
    assert json.loads(record.split(phases.MARKER, 1)[1])["notice_to_released_s"] == 15.0
    resumed = phases.Timeline()
    resumed.resumed_after = Suspension(noticed=125.0, released=140.0, stopped_at_deadline=False, node="n",
                                       slice_name="v6e-16-a")
    for phase, at in (("reserved", 150.0), ("step_started", 160.0), ("released", 200.0)):
        resumed.mark(phase, at)
    line, record = resumed.lines()
    assert "resumed after 20.00 s suspended" in line
    assert json.loads(record.split(phases.MARKER, 1)[1])["suspended"] == {
        "notice": 125.0, "released": 140.0, "stopped_at_deadline": False, "slice": "v6e-16-a", "resumed": 160.0,
        "suspended_s": 20.0}


# Issue 49: an attempt that does not end in success has its hosts' phases too, so its start-up lasts until
# the body started on every host, as on a successful one (not until the host processes started).
@pytest.mark.parametrize("ending", ["suspended", "failed", "step_timeout", "lost peer", "stopped"])
def test_an_attempt_that_ends_short_of_success_has_every_hosts_phases_and_true_start_up(monkeypatch, kv, ending):
    from rayslice.cluster import gang, host_loss, host_process, notices
    from rayslice.core.goodput import attempt_account
    from tests.rayslice.cluster import test_notice_rules as rules

    monkeypatch.setattr(gang, "ray", fake := rules.FakeRay())
    monkeypatch.setattr(host_loss, "ray", fake)
    monkeypatch.setattr(notices.internal_kv, "_internal_kv_get", lambda k, namespace=None, **kw: kv.get(k))
    reserved = 1000.0
    body = {"hosts_started": reserved + 1.0, "jax_ready": reserved + 6.0, "step_started": reserved + 6.5}

    def host(outcome):  # as HostProcess.run: it publishes its phases once its body starts, then ends its way
        ref = rules.Ref(outcome)

        def run(spec_json, plan, attempt):
            phases.publish(attempt.phases_key, plan.label, body).join()
            return ref
        return types.SimpleNamespace(run=types.SimpleNamespace(remote=run))

    stop = {"suspended": StepSuspended("saved"), "failed": ZeroDivisionError("bug"), "step_timeout": rules.HANG,
            "lost peer": RuntimeError("XlaRuntimeError: Connection reset"), "stopped": KeyboardInterrupt()}[ending]
    spec = rules.FUNCTION.model_copy(update={"step_timeout": 0.001 if ending == "step_timeout" else None})
    timeline = Timeline()
    timeline.mark("reserved", at=reserved)
    timeline.note("actors_started", reserved + 1.2)
    timeline.chips, timeline.outcome = 8, "preempted" if ending == "suspended" else "failed"
    with pytest.raises(BaseException):  # noqa: B017, PT011 (each ending raises its own error)
        gang.run_gang([host(stop), host(rules.HANG)], rules._plans(2), spec, host_process.Attempt(), timeline,
                      rules._noticed(3600) if ending == "suspended" else None)
    timeline.note("gang_returned")
    timeline.mark("released")
    assert [p for p in phases.PHASES if p in timeline.times] == ["reserved", "hosts_started", "jax_ready",
                                                                 "step_started", "step_done", "released"]
    summary = timeline.lines()[0]
    for phase in ("every host process started", "JAX imported and wired", "step started", "step done"):
        assert phase in summary
    account = attempt_account(timeline.record())
    assert account.seconds["startup"] == pytest.approx(6.5)  # reservation to the body on every host
    assert not [key for key in kv if key.startswith(phases.KEY_PREFIX)]  # read back, then forgotten


def test_an_attempt_whose_body_never_started_on_every_host_is_start_up_to_its_end():
    from rayslice.core.goodput import attempt_account

    record = {"reserved": 0.0, "released": 10.0, "chips": 4, "outcome": "failed",
              "detail": {"actors_started": 1.0, "gang_returned": 9.0},
              "hosts": [{"hosts_started": 0.5, "step_started": 5.0}, {"hosts_started": 0.6}]}
    account = attempt_account(record)
    assert account.seconds["startup"] == 9.0 and account.seconds["productive"] == 0.0
    assert account.seconds["teardown"] == 1.0


def test_phase_times_read_back_from_the_kv_are_finite_numbers_only(monkeypatch, kv):
    """Ray's KV has no owner per key: whatever wrote a host's key (its own program, another tenant's) must not
    make the attempt's figures NaN, which JSON carries through the record into the usage table and the metrics."""
    import math

    from rayslice.cluster import notices
    from rayslice.core.goodput import attempt_account

    monkeypatch.setattr(notices.internal_kv, "_internal_kv_get", lambda k, namespace=None, **kw: kv.get(k))
    key = phases.attempt_key("s1", 0, "abcd1234")
    kv[key + "a/host0"] = b'{"hosts_started": 1.0, "jax_ready": Infinity, "step_started": NaN}'
    kv[key + "a/host1"] = b'{"hosts_started": 1.5, "jax_ready": 2.0, "step_started": 3.0}'
    found = phases.published(key, {0: "a/host0", 1: "a/host1"})
    assert all(math.isfinite(v) for report in found.values() for v in report.values())
    timeline = Timeline()
    timeline.mark("reserved", at=0.0)
    timeline.hosts(phases.ended_short([{}, {}], found, 9.0))
    timeline.mark("released", at=10.0)
    timeline.chips = 4
    account = attempt_account(timeline.record())
    assert all(math.isfinite(v) for v in account.seconds.values())
    assert account.seconds["startup"] == 10.0  # host0's body start is unknown: start-up to the end


def test_a_hosts_key_whose_put_lands_after_the_driver_forgot_it_is_not_left_behind(monkeypatch, kv):
    """A loaded GCS: the host's put outlasts its bounded wait, the host returns its report, the driver forgets the
    keys, then the put lands. Nothing deletes it later: one key per such host, forever, in the GCS."""
    import threading

    from rayslice.cluster import notices

    landed, release = threading.Event(), threading.Event()
    put = notices.internal_kv._internal_kv_put

    def slow_put(k, v, namespace=None, **kw):
        release.wait(10)
        put(k, v, namespace=namespace)
        landed.set()

    monkeypatch.setattr(notices.internal_kv, "_internal_kv_put", slow_put)
    key = phases.attempt_key("s1", 0, "abcd1234")
    publishing = phases.publish(key, "a/host0", {"step_started": 1.0})
    publishing.leave(0.01, reported=True)  # the host returns its report
    phases.forget(key, ["a/host0"])  # the driver, once every host returned
    release.set()
    assert landed.wait(10)
    publishing.join(10)
    assert not [k for k in kv if k.startswith(phases.KEY_PREFIX)]
