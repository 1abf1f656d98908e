"""Elastic slice counts at their edges, without a cluster: templated counts, priority victims, growth after a shrink."""

from __future__ import annotations

import pytest

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.queue import QueueSettings, entry_for, growth, victims

BEST_EFFORT = QueueSettings()


def elastic(id, low=1, high=2, at=0.0, wait=10.0, team=None, most=None, priority=0):
    return entry_for(TpuSliceRequest(tpu="v6e-16", num_slices=(low, high), multislice=True, elastic_wait=wait),
                     id=id, label=f"dag.{id}", arrival=at, team=team, most_slices=most, priority=priority)


def fixed(id, slices=1, at=0.0, priority=0, preemptible=False, admitted=False):
    e = entry_for(TpuSliceRequest(tpu="v6e-16", num_slices=slices), id=id, label=f"dag.{id}", arrival=at,
                  priority=priority, preemptible=preemptible)
    if admitted:
        e.admitted, e.admitted_at = True, 1.0 + at
    return e


def admitted_on(entry, amount):
    entry.chips = entry.chips * amount / entry.amount
    entry.amount, entry.admitted, entry.admitted_at = amount, True, 1.0
    return entry


# ---- the request: templated spellings


@pytest.mark.parametrize("rendered", ["(1, 2)", "[1, 2]", ["1", "2"]])
def test_a_templated_elastic_count_as_airflow_renders_it_is_accepted(rendered):
    """`num_slices` is a template field; Jinja renders "{{ params.slices }}" to a string (without
    render_template_as_native_obj), and a fixed count "2" is accepted that way. An elastic pair is not."""
    assert TpuSliceRequest(tpu="v6e-16", num_slices="2").num_slices == 2  # holds for a fixed count
    request = TpuSliceRequest(tpu="v6e-16", num_slices=rendered, multislice=True)
    assert (request.min_slices, request.num_slices) == (1, 2)


def test_an_infinite_elastic_wait_is_refused_or_survives_the_specs_json():
    """The spec travels to the cluster as JSON (`__main__`, the hosts): elastic_wait=inf became null, i.e. 300 s."""
    try:
        request = TpuSliceRequest(tpu="v6e-16", num_slices=(1, 2), elastic_wait=float("inf"))
    except Exception:
        return  # refused when made: fine
    again = TpuSliceRequest.model_validate_json(request.model_dump_json())
    assert again.wait_for_all_s == request.wait_for_all_s


# ---- priority preemption


def test_an_elastic_head_suspends_only_what_its_least_needs():
    """It asks the queue for `min` (docs/elastic.md); `victims` sizes the suspension by `amount` (its max)."""
    running = [fixed("low1", preemptible=True, admitted=True, at=0),
               fixed("low2", preemptible=True, admitted=True, at=1)]
    head = elastic("urgent", low=1, high=2, at=5, priority=10)
    chosen = victims(head, running, total=2)
    assert len(chosen) == 1, [v.id for v in chosen]


# ---- growth after a shrink


def test_after_resuming_on_the_slices_left_it_is_offered_the_replacement_when_it_comes():
    """A (1, 3) step lost a slice and resumed on the 2 left (`most_slices=2`): its entry's max became 2,
    so when the third slice is back and free, `growth` never offers it (the issue: grow when slices free up)."""
    resumed = admitted_on(elastic("e", low=1, high=3, most=2), 2)
    assert growth([resumed], {}, {"v6e-16": 3}, BEST_EFFORT) == {"e": 1}


def test_after_a_loss_to_its_least_it_still_shows_and_grows_as_elastic():
    """(1, 2) after losing one slice: `most_slices=1` turns it into a plain 1-slice entry (not elastic)."""
    resumed = admitted_on(elastic("e", low=1, high=2, most=1), 1)
    assert resumed.elastic
    assert growth([resumed], {}, {"v6e-16": 2}, BEST_EFFORT) == {"e": 1}


# ---- the program's view of an offer, then a real notice


def test_a_drain_after_an_offer_to_grow_reaches_the_program():
    """A host process keeps the first notice it hears (`_Notices.deliver`: later ones are ignored). After an offer
    to grow (which the program may ignore), a drain or priority suspension never reaches it: it still reads
    `.grow == True` with a 10-year deadline, and is stopped at the real deadline without having checkpointed."""
    import time

    from rayslice.core import context

    context._notices.reset()
    try:
        context.deliver_notice(context.PreemptionNotice(deadline=time.time() + 3e8, reason="1 more free", grow=True))
        context.deliver_notice(context.PreemptionNotice(deadline=time.time() + 30, reason="node0 drained",
                                                        node="node0"))
        notice = context._notices.notice
        assert notice is not None and not notice.grow and notice.seconds_left <= 30, notice
    finally:
        context._notices.reset()


# ---- the operator


def test_an_elastic_pair_with_a_templated_end_is_not_refused_when_the_dag_is_parsed():
    """`num_slices` is a template field and Airflow renders inside tuples; `is_templated` looks at strings only,
    so `(1, "{{ params.max_slices }}")` fails the DAG import with "give a whole number of slices"."""
    from rayslice.operators.tpu_slice import TpuSliceOperator

    TpuSliceOperator(task_id="t", tpu="v6e-16", num_slices=(1, "{{ params.max_slices }}"), multislice=True,
                     callable="pkg.mod:fn")


# ---- an autoscaled cluster


def test_an_elastic_request_whose_least_an_autoscaler_can_hold_is_not_refused():
    """The broker refuses at registration (`refusal`) what an autoscaler's node groups can never hold. It
    compares `amount`, an elastic entry's max: (1, 4) where the groups hold at most 2 v6e-16 is refused with
    "can never run on this cluster", though it would run on 1 or 2."""
    from rayslice.core.queue import refusal

    e = elastic("e", low=1, high=4)
    assert refusal(e, {"v6e-16": 2}, {"v6e-16"}) is None
