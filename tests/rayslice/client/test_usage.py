"""`rayslice.client.usage.parse` on dashboard-shaped records: the cases a short real run does not produce.

A step still running (its bar ends now), a preemption retry (two gangs one after the other on one
lane: billed twice over time, drawn as one bar of the gang's size), a window that cuts a bar, and
actors that are not steps. The same arithmetic on real records is checked in test_capacity.py.
"""

from __future__ import annotations

import pytest

from rayslice.client import usage

NOW = 1_800_000_000.0
H = 3600.0


def _actor(name: str, start: float, end: float | None, resources: dict, node: str = "n1") -> dict:
    return {"name": name, "state": "ALIVE" if end is None else "DEAD", "startTime": int(start * 1000),
            "endTime": int(end * 1000) if end else 0, "requiredResources": resources, "address": {"nodeId": node}}


def _job(sid: str, task: str, start: float, status: str = "SUCCEEDED") -> dict:
    return {"submission_id": sid, "job_id": "02000000", "status": status, "start_time": int(start * 1000),
            "metadata": {"rayslice": "1", "dag_id": "d", "run_id": "r", "task_id": task, "request": "v6e-16",
                         "map_index": "-1", "try_number": "1"}}


def _nodes() -> dict:
    tpu = [{"node_id": f"t{i}", "state": "ALIVE", "resources_total": {"TPU": 4},
            "labels": {"ray.io/tpu-slice-name": "v6e-16-a", "ray.io/tpu-pod-type": "v6e-16"}} for i in range(4)]
    gpu = {"node_id": "g1", "state": "ALIVE", "resources_total": {"GPU": 3}, "labels": {}}
    return {"data": {"result": {"result": [*tpu, gpu]}}}


def _parse(actors: list[dict], jobs: list[dict], hours: float = 6) -> usage.Usage:
    body = {"data": {"actors": {str(i): a for i, a in enumerate(actors)}}}
    return usage.parse(_nodes(), body, jobs, now=NOW, hours=hours)


def test_a_running_step_is_billed_until_now_and_its_bar_is_open():
    actors = [_actor(f"rayslice:s1/v6e-16-a/host{w}", NOW - H, None, {"TPU": 4, "CPU": 1}) for w in range(4)]
    [bar] = _parse(actors, [_job("s1", "train", NOW - H - 30, "RUNNING")]).bars
    assert (bar.lane, bar.amount, bar.end, bar.waited_s) == ("v6e-16-a", 16, None, 30)
    assert bar.hours == pytest.approx(16.0)  # 16 chips x 1 h


def test_a_preemption_retry_bills_both_gangs_and_draws_one_bar_of_the_gang():
    first = [_actor(f"rayslice:s1/v6e-16-a/host{w}", NOW - 3 * H, NOW - 2 * H, {"TPU": 4}) for w in range(4)]
    retry = [_actor(f"rayslice:s1/v6e-16-a/host{w}", NOW - 2 * H + 60, NOW - H, {"TPU": 4}) for w in range(4)]
    [bar] = _parse(first + retry, [_job("s1", "train", NOW - 3 * H)]).bars
    assert bar.amount == 16 and bar.hours == pytest.approx(16 * (2 - 60 / H))
    assert bar.start.timestamp() == NOW - 3 * H and bar.end.timestamp() == NOW - H


def test_the_window_cuts_bars_and_drops_what_ended_before_it():
    actors = [_actor("rayslice:s1/GPU", NOW - 3 * H, NOW - H, {"GPU": 0.25}, node="g1"),
              _actor("rayslice:s2/GPU", NOW - 5 * H, NOW - 4 * H, {"GPU": 0.5}, node="g1"),
              _actor("someone-else", NOW - H, None, {"GPU": 1}, node="g1"),  # not a step: not on the timeline
              _actor("rayslice:s3/GPU", 0, None, {"GPU": 1}, node="g1")]  # never started: it only waited
    found = _parse(actors, [_job("s1", "eval", NOW - 3 * H), _job("s2", "old", NOW - 5 * H)], hours=2)
    [bar] = found.bars
    assert (bar.task_id, bar.lane, bar.kind) == ("eval", "g1", "gpu")
    assert bar.hours == pytest.approx(0.25 * 1)  # only the hour inside the 2 h window
    by_dag, by_task = usage.totals(found.bars)
    assert [(r.dag_id, r.steps, r.tpu_chip_hours, r.gpu_hours) for r in by_dag] == [("d", 1, 0, 0.25)]
    assert [lane.key for lane in found.lanes] == ["v6e-16-a", "g1"]


def test_every_accelerator_kind_is_drawn_and_billed_in_its_own_unit():
    """TPU, NPU, HPU and neuron-core fractions get bars and hours like GPU ones, each in its own unit."""
    nodes = _nodes()
    nodes["data"]["result"]["result"] += [
        {"node_id": "a1", "state": "ALIVE", "resources_total": {"NPU": 8, "HPU": 4, "neuron_cores": 2}, "labels": {}}]
    actors = [_actor("rayslice:s1/TPU", NOW - H, NOW, {"TPU": 0.5}, node="t1"),  # a fraction of a slice's host
              _actor("rayslice:s2/NPU", NOW - H, NOW, {"NPU": 2}, node="a1"),
              _actor("rayslice:s3/HPU", NOW - 2 * H, NOW, {"HPU": 0.25}, node="a1"),
              _actor("rayslice:s4/neuron_cores", NOW - H, None, {"neuron_cores": 1}, node="a1"),
              _actor("rayslice:s5/GPU", NOW - H, NOW, {"GPU": 0.5}, node="g1")]
    jobs = [_job(f"s{i}", f"t{i}", NOW - 2 * H) for i in range(1, 6)]
    found = usage.parse(nodes, {"data": {"actors": {str(i): a for i, a in enumerate(actors)}}}, jobs, now=NOW, hours=6)
    bars = {b.task_id: (b.lane, b.resource, b.amount, b.hours) for b in found.bars}
    assert bars == {"t1": ("v6e-16-a", "TPU", 0.5, 0.5), "t2": ("a1", "NPU", 2, 2), "t3": ("a1", "HPU", 0.25, 0.5),
                    "t4": ("a1", "neuron_cores", 1, 1), "t5": ("g1", "GPU", 0.5, 0.5)}
    [dag] = usage.totals(found.bars)[0]
    assert dag.hours == {"TPU": 0.5, "NPU": 2, "HPU": 0.5, "neuron_cores": 1, "GPU": 0.5}
    assert (dag.tpu_chip_hours, dag.gpu_hours, dag.steps) == (0.5, 0.5, 5)
    assert [(lane.key, lane.title) for lane in found.lanes] == [
        ("v6e-16-a", "v6e-16-a"), ("g1", "GPU node g1"), ("a1", "NPU node a1")]


def _figures(productive: float, held: float) -> dict:
    from rayslice.core.goodput import Account

    account = Account()
    account.chip_s["productive"], account.chip_s["startup"] = productive, held - productive
    account.held_chip_s, account.attempts = held, 1
    return account.to_json()


def test_rows_sum_their_measured_steps_goodput_and_say_how_many_had_figures():
    actors = [_actor(f"rayslice:{sid}/v6e-16-a/host0", NOW - 2 * H, NOW - H, {"TPU": 4}) for sid in ("s1", "s2", "s3")]
    found = _parse(actors, [_job("s1", "train", NOW - 2 * H), _job("s2", "train", NOW - 2 * H),
                            _job("s3", "eval", NOW - 2 * H)])
    found.goodput = {"s1": _figures(30.0, 100.0), "s2": _figures(50.0, 100.0)}  # s3: a log without a record
    by_dag, by_task = usage.totals(found.bars, found.goodput)
    rows = {r.task_id: r for r in by_task}
    assert (rows["train"].measured, rows["train"].steps, rows["train"].goodput) == (2, 2, 0.4)
    assert rows["train"].chip_h["productive"] == pytest.approx(80 / 3600, abs=1e-6)
    assert rows["train"].held_chip_h == pytest.approx(200 / 3600, abs=1e-6)
    assert (rows["eval"].measured, rows["eval"].goodput, rows["eval"].chip_h, rows["eval"].held_chip_h) == (
        0, None, {}, None)
    assert by_dag[0].goodput == 0.4 and by_dag[0].steps == 3  # a row without figures is never counted as zero
    assert usage.totals(found.bars)[0][0].goodput is None  # without figures: as before


def test_select_keeps_one_dag_task_or_team_and_a_team_takes_its_sub_teams():
    actors = [_actor(f"rayslice:{sid}/v6e-16-a/host0", NOW - H, NOW - 60, {"TPU": 4}) for sid in ("a", "b", "c")]
    jobs = [_job("a", "train", NOW - H), _job("b", "eval", NOW - H), _job("c", "train", NOW - H)]
    jobs[0]["metadata"]["team"], jobs[1]["metadata"]["team"] = "research/vision", "research"
    jobs[2]["metadata"]["team"] = "researchers"
    found = _parse(actors, jobs)
    assert {b.submission_id for b in usage.select(found, team="research")} == {"a", "b"}
    assert {b.submission_id for b in usage.select(found, team="research/vision")} == {"a"}
    assert {b.submission_id for b in usage.select(found, dag_id="d", task_id="train")} == {"a", "c"}
    assert usage.select(found, dag_id="other") == []


@pytest.mark.parametrize("endings", [["succeeded"], ["preempted", "succeeded"], ["preempted", "preempted"]])
def test_the_bill_is_the_chip_time_the_attempts_held_from_reservation_to_release(endings):
    """Issue 49: the seconds from the reservation to the host processes' start (their runtime env, the worker
    process) are held too, and a suspended attempt has many of them: billed, they agree with goodput's held time."""
    from rayslice.core import goodput

    actors, records, at = [], [], NOW - 2 * H
    for ending in endings:
        reserved, up, killed = at, at + 7.0, at + (29.0 if ending == "preempted" else 600.0)
        records.append({"queued": at - 5, "reserved": reserved, "hosts_started": up - 0.5, "step_started": up + 6,
                        "released": killed + 0.4, "chips": 16, "outcome": ending,
                        "detail": {"actors_started": up, "gang_returned": killed}})
        actors += [_actor(f"rayslice:s1/v6e-16-a/host{w}", up, killed, {"TPU": 4}) for w in range(4)]
        at = killed + 30
    account = goodput.step_account(records)
    found = usage.parse(_nodes(), {"data": {"actors": {str(i): a for i, a in enumerate(actors)}}},
                        [_job("s1", "train", NOW - 2 * H - 10)], now=NOW, hours=6,
                        goodput={"s1": account.to_json()})
    [bar] = found.bars
    assert bar.hours * H == pytest.approx(account.held_chip_s, rel=0.02)
    [row] = usage.totals(found.bars, found.goodput)[1]
    assert row.tpu_chip_hours == pytest.approx(row.held_chip_h, rel=0.02)


def test_a_window_that_cuts_an_attempt_bills_only_its_held_time_inside():
    from rayslice.core import goodput

    record = {"reserved": NOW - 3 * H, "step_started": NOW - 3 * H + 60, "released": NOW - H, "chips": 16,
              "outcome": "succeeded", "detail": {"actors_started": NOW - 3 * H + 50}}
    actors = [_actor(f"rayslice:s1/v6e-16-a/host{w}", NOW - 3 * H + 50, NOW - H - 1, {"TPU": 4}) for w in range(4)]
    found = usage.parse(_nodes(), {"data": {"actors": {str(i): a for i, a in enumerate(actors)}}},
                        [_job("s1", "train", NOW - 3 * H)], now=NOW, hours=2,
                        goodput={"s1": goodput.step_account([record]).to_json()})
    assert found.bars[0].hours == pytest.approx(16 * 1.0)  # the hour of its hold inside the 2 h window


@pytest.mark.parametrize("forged", [[[0.0, 1e15, 16]], [[NOW - 5 * H, NOW, 16]], [[NOW - 2 * H, float("inf"), 16]]])
def test_a_goodput_record_the_program_printed_bills_no_more_than_its_job_lived(forged):
    """The record is read back from the job's log, where the step's own program prints too: a program that prints
    a `goodput-record` line last names whatever holds it likes. A hold bills at most the job's life, and an absurd
    one never breaks `rayslice usage` for everyone (a year past 9999 raised out of the table)."""
    import json

    from rayslice.core import goodput
    from rayslice.core.step import GOODPUT_RECORD_MARKER

    start, end = NOW - 2 * H, NOW - H
    job = {**_job("s1", "train", start), "end_time": int(end * 1000)}
    actors = [_actor(f"rayslice:s1/v6e-16-a/host{w}", start + 60, end - 5, {"TPU": 4}) for w in range(4)]
    log = "\n".join([goodput.record_line(goodput.step_account([{"reserved": start + 20, "released": end - 2,
                                                                 "chips": 16}])),
                     GOODPUT_RECORD_MARKER + json.dumps({"attempts": 1, "held": forged}), "result line"])
    account = goodput.parse_record(log)
    found = usage.parse(_nodes(), {"data": {"actors": {str(i): a for i, a in enumerate(actors)}}}, [job],
                        now=NOW, hours=6, goodput={"s1": account.to_json()})
    [bar] = found.bars
    assert bar.hours * H <= 16 * (end - start + 2 * usage.CLOCK_SLACK_S)
    assert bar.hours * H >= 16 * (end - 5 - start - 60)  # never less than the host processes lived


def test_hosts_that_started_as_their_attempt_was_stopped_are_not_billed_the_next_attempts_hold():
    """A suspension (or a stop to grow) just as the hosts came up, and the next attempt reserved a second later: those
    hosts started within the clock slack of the next hold, but they are the first attempt's, and billed as such."""
    from rayslice.core import goodput

    at = NOW - 2 * H
    records = [{"reserved": at, "hosts_started": at + 29, "released": at + 30, "chips": 16, "outcome": "preempted",
                "detail": {"actors_started": at + 29, "gang_returned": at + 29.5}},
               {"reserved": at + 31, "hosts_started": at + 38, "step_started": at + 44, "released": at + 600,
                "chips": 16, "outcome": "succeeded", "detail": {"actors_started": at + 38}}]
    actors = [_actor(f"rayslice:s1/v6e-16-a/host{w}", at + 29, at + 29.5, {"TPU": 4}) for w in range(4)]
    actors += [_actor(f"rayslice:s1/v6e-16-a/host{w}", at + 38, at + 599, {"TPU": 4}) for w in range(4)]
    account = goodput.step_account(records)
    found = usage.parse(_nodes(), {"data": {"actors": {str(i): a for i, a in enumerate(actors)}}},
                        [_job("s1", "train", at - 10)], now=NOW, hours=6, goodput={"s1": account.to_json()})
    [bar] = found.bars
    assert bar.hours * H == pytest.approx(account.held_chip_s, rel=0.02)
