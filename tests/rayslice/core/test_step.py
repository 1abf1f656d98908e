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
