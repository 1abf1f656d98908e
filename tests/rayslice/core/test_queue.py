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
    assert decided.reasons["small"] == ""  # behind the big one, in its own line
    strictly = plan(entries, TOTALS, STRICT, now=10).reasons["tiny"]
    assert strictly == "held back by dag.big (waiting for 2 x v6e-16, served strictly)"
    assert plan(entries, TOTALS, STRICT, now=10).admit == []  # strict: nobody passes it
    entries[0].admitted = False  # the running step left: the big one is served first
    entries.pop(0)
    assert plan(entries, TOTALS, STRICT, now=10).admit == ["big"]


def test_priority_first_then_arrival():
    entries = [tpu("early", at=1), tpu("late-high", at=2, priority=5), tpu("later", at=3)]
    assert plan(entries, {"v6e-16": 1}, BEST_EFFORT, now=5).admit == ["late-high"]
    state = standing(entries, "later", plan(entries, {"v6e-16": 0.5}, BEST_EFFORT, now=5).reasons, now=5)
    assert describe(state) == "waiting for 1 x v6e-16: 3rd in line behind dag.early (priority 0, waiting 4 s)"


def test_aging_serves_a_long_waiting_request_strictly():
    entries = [tpu("run", admitted=True), tpu("run2", admitted=True), tpu("old", at=0), tpu("tiny", "v6e-4", at=1)]
    settings = QueueSettings(aging_s=60)
    assert plan(entries, TOTALS, settings, now=59).admit == ["tiny"]
    assert plan(entries, TOTALS, settings, now=61).admit == []


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
    from rayslice.hooks.ray import _queue

    assert _queue('{"policy": "strict"}') == STRICT
    with pytest.raises(InvalidRequestError, match="extra 'queue'"):
        _queue({"aging": 5})
