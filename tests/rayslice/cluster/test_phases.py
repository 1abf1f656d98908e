"""The phase lines a step's job log ends with: one readable summary, one machine-readable record."""

from __future__ import annotations

import json

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
