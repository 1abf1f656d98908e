"""Elastic slice counts without a cluster: the request's spelling, and how the queue admits and grows it."""

from __future__ import annotations

import time

import pytest

from rayslice.core.accelerators import ELASTIC_WAIT_S, TpuSliceRequest
from rayslice.core.context import PreemptionNotice, StepContext
from rayslice.core.exceptions import InvalidRequestError
from rayslice.core.queue import QueueSettings, entry_for, growth, lines_of, plan

TWO = {"v6e-16": 2}
BEST_EFFORT = QueueSettings()


def elastic(id, low=1, high=2, at=0.0, wait=10.0, team=None, admitted=False, most=None, least=None):
    entry = entry_for(TpuSliceRequest(tpu="v6e-16", num_slices=(low, high), multislice=True, elastic_wait=wait),
                      id=id, label=f"dag.{id}", arrival=at, team=team, most_slices=most, least_slices=least)
    entry.admitted = admitted
    return entry


def fixed(id, slices=1, at=0.0, team=None, admitted=False):
    entry = entry_for(TpuSliceRequest(tpu="v6e-16", num_slices=slices), id=id, label=f"dag.{id}", arrival=at,
                      team=team)
    entry.admitted = admitted
    return entry


def admitted_on(entry, amount):
    """`entry` as the broker holds it once admitted on `amount` slices (`rayslice.cluster.queue.granted`)."""
    entry.chips = entry.chips * amount / entry.amount
    entry.amount, entry.admitted, entry.admitted_at = amount, True, 1.0
    return entry


# ---- the request


def test_num_slices_takes_a_min_max_pair_on_every_spelling_and_survives_json():
    request = TpuSliceRequest(tpu="v6e-16", num_slices=(1, 3), multislice=True)
    assert (request.min_slices, request.num_slices, request.elastic) == (1, 3, True)
    assert TpuSliceRequest(tpu="v6e-16", num_slices=[1, 3], multislice=True) == request  # JSON lists, templates
    assert TpuSliceRequest.model_validate_json(request.model_dump_json()) == request
    assert str(request) == "v6e-16 x1-3 (multislice)"
    assert request.wait_for_all_s == ELASTIC_WAIT_S
    assert TpuSliceRequest(tpu="v6e-16", num_slices=(2, 2)) == TpuSliceRequest(tpu="v6e-16", num_slices=2)


def test_one_attempt_runs_on_a_fixed_count_and_one_slice_is_not_multislice():
    request = TpuSliceRequest(tpu="v6e-16", num_slices=(1, 3), multislice=True, elastic_wait=5)
    one, two = request.with_slices(1), request.with_slices(2)
    assert (one.num_slices, one.multislice, one.elastic) == (1, False, False)
    assert (two.num_slices, two.multislice, two.total_chips) == (2, True, 32)


@pytest.mark.parametrize(("arguments", "says"), [
    ({"num_slices": (2, 1)}, "1 <= min <= max"),
    ({"num_slices": (0, 2)}, "1 <= min <= max"),
    ({"num_slices": (1, 2, 3)}, "(min, max)"),
    ({"num_slices": (1.5, 2)}, "(min, max)"),
    ({"num_slices": 2, "elastic_wait": 30}, "elastic_wait=30 applies to an elastic count only"),
    ({"num_slices": (1, 2), "elastic_wait": -1}, "elastic_wait"),
    ({"num_slices": 2, "min_slices": 2}, "min_slices=2 must be below num_slices=2"),
    ({"num_slices": (1, 2), "subslice": "2x4"}, "num_slices must be 1"),
])
def test_a_bad_elastic_count_is_refused_when_the_request_is_made(arguments, says):
    with pytest.raises(InvalidRequestError, match=says.replace("(", r"\(").replace(")", r"\)")):
        TpuSliceRequest(tpu="v6e-16", **arguments)


def test_the_context_tells_a_program_how_many_slices_it_runs_on():
    context = StepContext(dag_id="d", run_id="r", task_id="t", map_index=-1, try_number=1, submission_id="s",
                          preemption_attempt=1, slice_index=0, slice_name="a", worker_id=0, process_index=0,
                          num_processes=8, checkpoint_dir=None, num_slices=2)
    assert StepContext.from_env(context.to_env()) == context
    older = {k: v for k, v in context.to_env().items() if k != "RAYSLICE_NUM_SLICES"}
    assert StepContext.from_env(older).num_slices == 1  # a launcher before elastic counts sent none
    notice = PreemptionNotice(deadline=time.time() + 60, reason="1 more v6e-16 free", grow=True)
    assert PreemptionNotice.from_json(notice.to_json()).grow is True
    assert PreemptionNotice.from_json('{"deadline": 1, "reason": "r"}').grow is False


# ---- admission


def test_alone_it_starts_on_all_its_slices_at_once_when_they_are_free():
    decided = plan([elastic("e")], TWO, BEST_EFFORT, now=1)
    assert decided.admit == ["e"] and decided.amounts == {"e": 2}


def test_alone_it_waits_up_to_elastic_wait_for_all_then_starts_on_what_is_free():
    entries = [fixed("busy", admitted=True), elastic("e", at=0, wait=10)]
    before = plan(entries, TWO, BEST_EFFORT, now=5)
    assert before.admit == []
    assert "waiting up to 5 s more for all 2 v6e-16" in before.reasons["e"]
    after = plan(entries, TWO, BEST_EFFORT, now=10)
    assert after.admit == ["e"] and after.amounts == {"e": 1}


def test_with_someone_behind_it_asks_for_its_least_and_leaves_the_rest():
    entries = [elastic("e", at=0), fixed("later", at=1)]
    decided = plan(entries, TWO, BEST_EFFORT, now=1)
    assert decided.admit == ["e", "later"]
    assert decided.amounts == {"e": 1}


def test_below_its_least_it_waits_and_holds_its_line_like_any_request():
    entries = [fixed("busy", slices=2, admitted=True), elastic("e", low=2, high=3, at=0), fixed("later", at=1)]
    decided = plan(entries, {"v6e-16": 3}, BEST_EFFORT, now=100)
    assert decided.admit == []  # the one free slice is not the later step's: it stays behind
    assert "first in line; 2 of 3 v6e-16 in use" in decided.reasons["e"]


def test_a_slice_gone_for_good_is_not_waited_for_but_its_least_is():
    """A cluster left with one intact v6e-16: a (1, 2) step starts on it; a (2, 3) step waits for hosts to return."""
    assert plan([elastic("e", at=0)], {"v6e-16": 1}, BEST_EFFORT, now=100).amounts == {"e": 1}
    assert plan([elastic("e", low=2, high=3)], {"v6e-16": 1}, BEST_EFFORT, now=100).admit == []


def test_after_a_loss_the_launcher_asks_for_no_more_than_the_slices_left():
    capped = elastic("e", low=1, high=3, most=2)  # it may still grow to 3 later
    assert (capped.min_amount, capped.max_amount, capped.amount, capped.chips) == (1, 3, 2, 32)
    at_least = elastic("e", low=2, high=3, most=1)  # never below its least: it waits for a slice to return
    assert (at_least.elastic, at_least.amount) == (True, 2)
    regrow = elastic("e", low=1, high=3, least=2)  # stopped to grow from 2: it never comes back on fewer
    assert (regrow.min_amount, regrow.amount) == (2, 3)


def test_a_team_quota_bounds_what_it_takes_and_an_over_quota_team_borrows_only_its_least():
    quota = QueueSettings(quotas={"research": {"v6e-16": 16}})
    decided = plan([elastic("e", team="research")], TWO, quota, now=100)
    assert decided.amounts == {"e": 1}  # 2 are free, but its team may hold 16 chips
    over = QueueSettings(quotas={"research": {"v6e-16": 0}})
    borrowed = plan([elastic("e", team="research", at=0)], {"v6e-16": 3}, over, now=100)
    assert borrowed.admit == ["e"] and borrowed.amounts == {"e": 1}


# ---- growth


def test_a_step_on_fewer_slices_is_offered_the_free_ones_when_nobody_waits():
    running = [admitted_on(elastic("e", low=1, high=3), 1)]
    assert growth(running, {}, {"v6e-16": 3}, BEST_EFFORT) == {"e": 2}
    busy = [*running, fixed("other", admitted=True)]
    assert growth(busy, {}, {"v6e-16": 3}, BEST_EFFORT) == {"e": 1}
    assert growth(running, {}, {"v6e-16": 1}, BEST_EFFORT) == {}  # nothing free


def test_no_growth_while_someone_waits_for_that_type_nor_onto_what_an_autoscaler_might_add():
    running = [admitted_on(elastic("e"), 1)]
    waiting = lines_of([fixed("later", at=5)])
    assert growth(running, waiting, TWO, BEST_EFFORT) == {}
    assert growth(running, {}, {"v6e-16": float("inf")}, BEST_EFFORT) == {}


def test_growth_stays_within_the_team_quota_and_an_offer_made_counts_as_taken():
    running = [admitted_on(elastic("e", low=1, high=3, team="research"), 1)]
    quota = QueueSettings(quotas={"research": {"v6e-16": 32}})
    assert growth(running, {}, {"v6e-16": 3}, quota) == {"e": 1}
    second = admitted_on(elastic("f", low=1, high=2), 1)
    second.admitted_at = 2.0
    both = [*running, second]
    assert growth(both, {}, {"v6e-16": 3}, BEST_EFFORT) == {"e": 1}  # the earlier admitted first
    assert growth(both, {}, {"v6e-16": 4}, BEST_EFFORT, offered={"e": 2}) == {}  # e may take 2 more
    assert growth(both, {}, {"v6e-16": 4}, BEST_EFFORT, offered={"e": 1}) == {"f": 1}
