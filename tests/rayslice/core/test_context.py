"""`get_step_context()` and the checkpoint folder rule, without a cluster."""

from __future__ import annotations

import pytest

from rayslice import RaysliceError, as_path, get_step_context
from rayslice.core.context import checkpoint_dir_for
from rayslice.core.step import Owner

TASK = Owner(dag_id="train_daily", run_id="scheduled__2026-11-30T00:00:00+00:00", task_id="train", try_number=1,
             ti_id="0193aa", submission_id="rayslice-train_daily--train-abc-try1-0193aa")


def test_outside_a_step_it_says_where_it_works():
    with pytest.raises(RaysliceError, match="only inside a step run by rayslice"):
        get_step_context()


def test_every_try_of_a_task_in_a_run_shares_one_folder():
    root = "gs://bucket/ckpt"
    first = checkpoint_dir_for(root, TASK)
    assert first.startswith("gs://bucket/ckpt/train_daily/scheduled__2026-11-30T00_00_00_00_00-")
    assert first.endswith("/train")
    again = TASK.model_copy(update={"try_number": 3, "ti_id": "0193ff", "submission_id": "other"})
    assert checkpoint_dir_for(root, again) == first  # other tries (and preemption attempts) resume from it


@pytest.mark.parametrize(
    "other",
    [
        TASK.model_copy(update={"run_id": "scheduled__2026-12-01T00:00:00+00:00"}),
        TASK.model_copy(update={"task_id": "evaluate"}),
        TASK.model_copy(update={"map_index": 0}),
        TASK.model_copy(update={"map_index": 1}),
        TASK.model_copy(update={"run_id": "scheduled__2026-11-30T00:00:00_00:00"}),  # same once made path-safe
    ],
    ids=["other-run", "other-task", "map-index-0", "map-index-1", "run-id-that-sanitizes-alike"],
)
def test_other_runs_tasks_and_map_indexes_get_other_folders(other):
    assert checkpoint_dir_for("s3://b/c", other) != checkpoint_dir_for("s3://b/c", TASK)


def test_another_airflow_deployment_gets_its_own_folder_under_its_name():
    prod, staging = (TASK.model_copy(update={"deployment": name}) for name in ("prod", "staging"))
    assert checkpoint_dir_for("gs://b/c", prod).startswith("gs://b/c/prod/train_daily/")
    assert checkpoint_dir_for("gs://b/c", staging).startswith("gs://b/c/staging/train_daily/")


def test_a_recreated_run_with_the_same_run_id_gets_its_predecessors_folder():
    recreated = TASK.model_copy(update={"ti_id": "fresh-ti", "submission_id": "fresh"})
    assert checkpoint_dir_for("file:///ckpt", recreated) == checkpoint_dir_for("file:///ckpt", TASK)


def test_no_root_means_no_folder_and_plain_paths_become_file_urls():
    assert checkpoint_dir_for(None, TASK) is None and checkpoint_dir_for("", TASK) is None
    assert checkpoint_dir_for("/shared/ckpt", TASK).startswith("file:///shared/ckpt/train_daily/")


def test_a_step_outside_airflow_gets_a_folder_of_its_own_submission():
    assert checkpoint_dir_for("file:///ckpt", Owner(submission_id="rayslice-adhoc-1")) == \
        "file:///ckpt/adhoc/rayslice-adhoc-1"


def test_libraries_get_plain_paths_for_local_urls_only():
    assert as_path("file:///tmp/ckpt/4") == "/tmp/ckpt/4"
    assert as_path("gs://bucket/ckpt/4") == "gs://bucket/ckpt/4"


def test_a_command_step_reads_its_context_from_documented_variables(monkeypatch):
    from rayslice.core.context import StepContext, get_step_context

    context = StepContext(dag_id="d", run_id="r", task_id="t", map_index=-1, try_number=2, submission_id="s",
                          preemption_attempt=1, slice_index=0, slice_name="v6e-16-a", worker_id=3,
                          process_index=3, num_processes=4, checkpoint_dir="file:///ckpt/d/r/t")
    env = context.to_env()
    assert env["RAYSLICE_WORKER_ID"] == "3" and env["RAYSLICE_CHECKPOINT_DIR"] == "file:///ckpt/d/r/t"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert get_step_context() == context


def test_a_host_process_imports_no_fsspec_until_a_checkpoint_url_is_split():
    """Every host process imports the launcher's host module before JAX: fsspec is not part of that start."""
    import subprocess
    import sys

    probe = ("import sys, rayslice.cluster.host_process, rayslice.cluster; assert 'fsspec' not in sys.modules\n"
             "from rayslice.core.context import as_path; assert as_path('file:///ckpt') == '/ckpt'\n"
             "assert 'fsspec' in sys.modules")
    subprocess.run([sys.executable, "-c", probe], check=True)
