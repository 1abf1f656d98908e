"""The step's records: which Airflow task try they name, read back from a Ray job's metadata."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import Owner, StepSpec, TaskRef


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


def test_an_error_line_carries_where_the_step_failed():
    from rayslice.core.exceptions import StepFailedError, error_fields
    from rayslice.core.step import format_error, parse_error

    exc = StepFailedError("step failed", slice_index=1, worker_id=3, host="10.0.0.7", cause="exit", exit_code=3)
    line = format_error("StepFailedError", str(exc), "t1", error_fields(exc))
    assert parse_error(line, "t1") == {"type": "StepFailedError", "message": "step failed", "fields": {
        "slice_index": 1, "worker_id": 3, "host": "10.0.0.7", "cause": "exit", "exit_code": 3}}
    forged = '::rayslice-error::{"type": "StepFailedError", "message": "m", "fields": {"evil": 1, "host": "h"}}'
    assert parse_error(forged)["fields"] == {"host": "h"}  # only the known fields are taken
    assert parse_error(format_error("CapacityTimeoutError", "waited"))["fields"] == {}


def test_a_command_is_an_argv_and_a_string_is_split_like_a_shell():
    from rayslice.core.accelerators import TpuSliceRequest
    from rayslice.core.step import StepSpec

    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-4"), command="python -m trainer.main --config 'a b.yaml'")
    assert spec.command == ["python", "-m", "trainer.main", "--config", "a b.yaml"]
    assert StepSpec.model_validate_json(spec.model_dump_json()) == spec


def test_a_step_runs_exactly_one_program():
    from rayslice.core.accelerators import TpuSliceRequest
    from rayslice.core.step import StepSpec

    request = TpuSliceRequest(tpu="v6e-4")  # pydantic wraps the InvalidRequestError in its ValueError
    with pytest.raises(ValueError, match="exactly one of `callable`.*; got callable, command"):
        StepSpec(request=request, callable="pkg.mod:fn", command=["python"])
    with pytest.raises(ValueError, match="non-empty argv list"):
        StepSpec(request=request, command="")
    with pytest.raises(ValueError, match="unknown key"):
        StepSpec(request=request, command=["python"], runtime_env={"env": {}})


def test_entrypoint_is_the_deprecated_name_of_callable():
    from rayslice.core.accelerators import TpuSliceRequest
    from rayslice.core.step import StepSpec

    with pytest.warns(DeprecationWarning, match="use callable='package.module:function'"):
        spec = StepSpec(request=TpuSliceRequest(tpu="v6e-4"), entrypoint="pkg.mod:fn")
    assert spec.callable == spec.entrypoint == "pkg.mod:fn"


def test_a_step_cannot_set_the_clusters_queue_policy():
    """Issue 38 (3): a step's `queue=` replaced the whole cluster's policy and quotas."""
    from rayslice.core.queue import QueueSettings

    with pytest.raises(ValueError, match="a step cannot set the cluster's queue policy or quotas .*"
                                                  "cluster operator's, set on the head \\(RAYSLICE_QUEUE\\)"):
        StepSpec(request=TpuSliceRequest(tpu="v6e-4"), callable="m:f", queue=QueueSettings(quotas={"a": {}}))
    assert StepSpec.model_validate({"request": {"kind": "tpu_slice", "tpu": "v6e-4"}, "callable": "m:f",
                                    "queue": None}).team is None  # an older submitter's spec.json without one


@pytest.mark.parametrize("root", ["file://ckpt", "file://./ckpt", "local://ckpt", "/shared/ckpt"])
def test_a_checkpoint_root_that_is_no_url_or_a_relative_file_url_is_refused(root):
    """Issue 49 finding 11: `file://ckpt` resolved inside each host's per-step folder, deleted after the step."""
    with pytest.raises(ValidationError, match="checkpoint_root must be a URL like 'gs://bucket/checkpoints'"):
        StepSpec(request=TpuSliceRequest(tpu="v6e-4"), command=["true"], checkpoint_root=root)


@pytest.mark.parametrize("root", ["file:///shared/ckpt", "gs://bucket/ckpt", "s3://b/c", "local:///shared/ckpt"])
def test_an_absolute_file_url_and_object_storage_roots_are_taken(root):
    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-4"), command=["true"], checkpoint_root=root)
    assert spec.checkpoint_root == root



@pytest.mark.parametrize("root", ["file://~/ckpt", "file:/shared/ckpt", "file://localhost/shared/ckpt",
                                  "file://../ckpt"])
def test_file_urls_that_do_not_name_an_absolute_path_are_refused(root):
    """Held in review: a home folder, a one-slash URL and a host part all resolve relative to each host's step folder
    (fsspec reads `file://~/x` as the path `~/x`), or are no URL."""
    with pytest.raises(ValidationError, match="checkpoint_root must be a URL like"):
        StepSpec(request=TpuSliceRequest(tpu="v6e-4"), command=["true"], checkpoint_root=root)


@pytest.mark.parametrize(("root", "why"), [
    ("FILE:///shared/ckpt", "lowercase"),  # fsspec knows no FILE://; as_path passed it on to orbax as a relative path
    (" file://ckpt", "lowercase"),  # a stray space before a templated value: no protocol fsspec knows
    ("simplecache::file://ckpt", "absolute path"),  # a chained URL's target is its last part: relative here
    ("memory://ckpt", "memory"),  # each host process's own memory: gone with it, so every resume starts fresh
])
def test_a_checkpoint_root_that_would_lose_its_checkpoints_at_run_time_is_refused_at_parse_time(root, why):
    """Review of issue 49 finding 11's fix: these passed the parse-time check and lost every checkpoint."""
    with pytest.raises(ValidationError, match=f"checkpoint_root must be a URL like.*{why}"):
        StepSpec(request=TpuSliceRequest(tpu="v6e-4"), command=["true"], checkpoint_root=root)


def test_a_chained_url_to_object_storage_or_an_absolute_file_path_is_taken():
    for root in ("simplecache::gs://bucket/ckpt", "simplecache::file:///shared/ckpt"):
        assert StepSpec(request=TpuSliceRequest(tpu="v6e-4"), command=["true"], checkpoint_root=root).checkpoint_root
