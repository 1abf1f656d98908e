"""The step's records: which Airflow task try they name, read back from a Ray job's metadata."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rayslice.core.step import Owner, TaskRef


def test_task_fields_read_from_job_metadata_turn_numbers_back_into_ints():
    meta = {"rayslice": "1", "dag_id": "train", "run_id": "r1", "task_id": "step", "map_index": "3",
            "try_number": "2", "request": "v6e-16"}
    assert TaskRef.fields_from(meta) == {"dag_id": "train", "run_id": "r1", "task_id": "step", "map_index": 3,
                                         "try_number": 2}


def test_gaps_and_unreadable_numbers_in_metadata_get_the_defaults():
    assert TaskRef.fields_from({"map_index": "x", "try_number": None}) == TaskRef().model_dump()


def test_an_owner_is_a_frozen_task_ref_with_its_try_id():
    owner = Owner(**TaskRef.fields_from({"dag_id": "d", "map_index": "1"}), ti_id="uuid")
    assert (owner.dag_id, owner.map_index, owner.ti_id) == ("d", 1, "uuid")
    with pytest.raises(ValidationError):
        owner.dag_id = "other"


def test_only_a_line_that_starts_with_the_steps_own_tagged_marker_counts():
    from rayslice.core.step import format_error, format_result, parse_error, parse_result

    log = "\n".join([
        format_result("own", tag="ab12"),
        'copied from another job: ::rayslice-result::"spoofed"',
        format_result("another job's", tag="ffff"),
        "\x1b[36m(v6e-4/host0 pid=1)\x1b[0m " + format_error("StepFailedError", "printed", tag="ab12"),
        '::rayslice-result::"untagged"',
    ])
    assert parse_result(log, "ab12") == (True, "own")
    assert parse_error(log, "ab12") is None
    assert parse_result(log) == (True, "untagged")  # a job submitted without a tag: line start only


@pytest.mark.parametrize("line", ["::rayslice-result::not json", "::rayslice-error::{not json",
                                  '::rayslice-error::["no", "type"]'])
def test_a_malformed_driver_marker_is_a_step_failure_not_a_value_error(line):
    from rayslice.core.exceptions import StepFailedError
    from rayslice.core.step import parse_error, parse_result

    with pytest.raises(StepFailedError, match="the job's log has a ::rayslice-"):
        parse_result(line) if "result" in line else parse_error(line)
