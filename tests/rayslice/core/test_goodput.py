"""Goodput figures: every second of chip-time held lands in exactly one category, lost work is what was redone."""

from __future__ import annotations

import math
import os

import pytest

from rayslice.core import goodput
from rayslice.core.goodput import HELD, Account, attempt_account, parse_record, record_line, step_account

STEP_S = 1.0  # one training step
SAVE_EVERY = 10  # steps between checkpoints
SAVE_S = 0.5
CHIPS = 32  # two v6e-16


def simulated_run(total_steps: int, preempt_at_step: int | None) -> tuple[list[dict], int]:
    """A training run as the launcher records it: each attempt's phase record, and how many steps were redone.

    The clock advances as a real run's would: queue, start-up, steps, checkpoints; a preemption loses
    what came after the last checkpoint, and the resume starts again from that checkpoint.
    """
    records, clock, done, redone, executed = [], 1000.0, 0, 0, set()
    outcome = None
    while outcome != "succeeded":
        record: dict = {"detail": {"queued": clock}, "chips": CHIPS, "spans": {"checkpointing": []}}
        if not records:
            record["accepted"] = clock - 1.0
        clock += 7.0  # the queue
        record["detail"]["admitted"] = clock
        clock += 0.5
        record["reserved"] = clock
        clock += 4.0  # host processes, JAX
        record["step_started"] = clock
        step = done  # resumes from the last checkpoint
        while step < total_steps:
            if preempt_at_step is not None and step == preempt_at_step and len(records) == 0:
                break
            clock += STEP_S
            redone += step in executed
            executed.add(step)
            step += 1
            if step % SAVE_EVERY == 0:
                record["spans"]["checkpointing"].append([clock, clock + SAVE_S])
                clock += SAVE_S
                done = step
        if step == total_steps:
            record["step_done"], outcome = clock, "succeeded"
        else:
            record["detail"]["gang_returned"], outcome = clock, "preempted"
        clock += 0.3
        record["released"] = clock
        record["outcome"] = outcome
        records.append(record)
        clock += 2.0
    return records, redone


def test_a_run_with_one_preemption_adds_up_to_the_chip_time_held_and_lost_is_the_steps_redone():
    records, redone = simulated_run(total_steps=100, preempt_at_step=37)
    account = step_account(records)
    held = sum((r["released"] - r["reserved"]) * CHIPS for r in records)
    assert account.attempts == 2
    assert math.isclose(account.held_chip_s, held, rel_tol=1e-9)
    assert math.isclose(sum(account.chip_s[c] for c in HELD), held, rel_tol=0.01)
    assert redone == 7  # steps 30..36 ran twice
    assert account.seconds["lost"] == pytest.approx(redone * STEP_S)
    assert account.chip_s["lost"] == pytest.approx(redone * STEP_S * CHIPS)
    assert account.seconds["productive"] == pytest.approx((100 + 0) * STEP_S)  # every step once, counted once
    assert account.seconds["checkpointing"] == pytest.approx(10 * SAVE_S)  # 3 saves, then 7 more after the resume
    assert account.seconds["startup"] == pytest.approx(2 * 4.0)
    assert account.seconds["waiting"] == pytest.approx(8.5 + 7.5)  # accepted -> reserved, then queued -> reserved
    assert account.goodput == pytest.approx(account.chip_s["productive"] / held)


def test_a_run_without_preemption_loses_nothing():
    records, redone = simulated_run(total_steps=30, preempt_at_step=None)
    account = step_account(records)
    assert redone == 0 and account.seconds["lost"] == 0 and account.attempts == 1
    assert account.seconds["productive"] == pytest.approx(30 * STEP_S)


def test_a_lost_span_from_the_preemption_path_is_taken_as_given():
    """The suspend/requeue path knows where the last checkpoint was and records the lost span itself."""
    record = {"reserved": 0.0, "step_started": 1.0, "detail": {"gang_returned": 11.0}, "released": 12.0,
              "chips": 4, "outcome": "preempted", "spans": {"lost": [[8.0, 11.0]], "checkpointing": [[6.0, 8.0]]}}
    account = attempt_account(record)
    assert account.seconds == {"startup": 1.0, "productive": 5.0, "checkpointing": 2.0, "lost": 3.0, "teardown": 1.0,
                               "waiting": 0.0, "suspended": 0.0}
    assert account.held_chip_s == 48.0


def test_suspended_spans_are_counted_but_not_held():
    """A record of suspended spans only (capacity given back until the requeued step starts again)."""
    account = step_account([{"chips": 16, "spans": {"suspended": [[10.0, 40.0], [30.0, 50.0]]}}])
    assert account.seconds["suspended"] == 40.0 and account.chip_s["suspended"] == 640.0
    assert account.held_chip_s == 0 and account.goodput is None and account.attempts == 0


def test_clocks_out_of_order_never_make_figures_that_do_not_add_up():
    """Host clocks that ran ahead of the driver's (a step 'done' after the release) are clipped to the hold."""
    record = {"reserved": 10.0, "step_started": 9.0, "step_done": 30.0, "released": 20.0, "chips": 8,
              "spans": {"checkpointing": [[5.0, 12.0], [11.0, 13.0], [19.0, 25.0]]}}
    account = attempt_account(record)
    assert all(v >= 0 for v in account.seconds.values())
    assert sum(account.chip_s[c] for c in HELD) == pytest.approx(account.held_chip_s) == 80.0
    assert account.seconds["checkpointing"] == 4.0  # 10..13 and 19..20: overlaps joined, clipped to the hold


def test_an_attempt_that_never_got_capacity_holds_nothing():
    account = attempt_account({"accepted": 1.0, "detail": {"queued": 2.0}, "chips": 16, "outcome": "failed"})
    assert account.held_chip_s == 0 and account.attempts == 0 and account.summary().endswith("no chip-time held")


def test_the_record_line_reads_back_and_the_summary_names_each_category():
    records, _ = simulated_run(total_steps=40, preempt_at_step=25)
    account = step_account(records)
    log = "\n".join(["other output", account.summary(), record_line(account), "::rayslice-result::x::1"])
    back = parse_record(log)
    assert back is not None and back.to_json() == account.to_json()
    summary = account.summary()
    assert summary.startswith("[rayslice] goodput: ") and "over 2 attempts" in summary
    for name in ("startup", "productive", "checkpointing", "lost", "teardown", "waiting"):
        assert name in summary
    assert parse_record("no record here\n[rayslice] goodput-record: {not json") is None
    assert Account.from_json({}).to_json()["goodput"] is None


def test_a_step_reports_checkpoint_spans_through_its_context(tmp_path, monkeypatch):
    from rayslice.core.context import StepContext

    context = StepContext(dag_id="d", run_id="r", task_id="t", map_index=-1, try_number=1, submission_id="s",
                          preemption_attempt=0, slice_index=0, slice_name="v6e-16-a", worker_id=0,
                          process_index=0, num_processes=1, checkpoint_dir=None)
    goodput.collect()
    with context.checkpointing():
        pass
    context.report_checkpoint(5.0, 7.5)
    spans = goodput.collect()
    assert len(spans["checkpointing"]) == 2 and spans["checkpointing"][1] == [5.0, 7.5]
    assert goodput.collect() == {}  # collected once
    # A command step's program: the spans go to the file its host reads after it.
    path = tmp_path / "spans.jsonl"
    monkeypatch.setenv(goodput.SPANS_FILE_ENV, str(path))
    context.report_checkpoint(1.0, 2.0)
    with open(path, "a") as torn:
        torn.write('["checkpointing", 3.0')  # a program killed mid-write
    monkeypatch.delenv(goodput.SPANS_FILE_ENV)
    assert goodput.collect(str(path)) == {"checkpointing": [[1.0, 2.0]]}
    assert not os.environ.get(goodput.SPANS_FILE_ENV)


@pytest.mark.parametrize(("kind", "start", "end", "says"), [
    ("saving", 1.0, 2.0, "kind='saving' is not a span kind: use checkpointing, lost, suspended"),
    ("checkpointing", 2.0, 1.0, "must end at or after its start"),
    ("checkpointing", float("nan"), 1.0, "must end at or after its start"),
])
def test_a_bad_span_is_refused_in_words(kind, start, end, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        goodput.report_span(kind, start, end)


@pytest.mark.parametrize("printed", ["{line}", "\r{line}", "progress 99%\r{line}"])
def test_a_record_a_host_printed_after_the_drivers_is_not_the_steps(printed):
    """The job log holds the hosts' output too, each line behind Ray's `(label pid=…)` prefix, and a host's late
    line may follow the driver's record: the step's program cannot name its own figures or billed holds."""
    records, _ = simulated_run(total_steps=40, preempt_at_step=25)
    account = step_account(records)
    forged = record_line(Account(attempts=1, held=[[0.0, 1e12, 64.0]]))
    log = "\n".join([record_line(account), "::rayslice-result::x::1",
                     "(v6e-16-a/host1 pid=4242, ip=10.0.0.2) " + printed.format(line=forged)])
    back = parse_record(log)
    assert back is not None and back.to_json() == account.to_json()
