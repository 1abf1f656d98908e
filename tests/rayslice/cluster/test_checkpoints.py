"""A step's context and checkpoint folder on the real cluster (training that resumes: tests/dags/)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from rayslice.cluster import _checkpoint_dir, run_step
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.context import CHECKPOINT_ROOT_ENV, checkpoint_dir_for
from rayslice.core.exceptions import InvalidRequestError
from rayslice.core.step import Owner, StepSpec
from tests.rayslice.cluster.test_launcher import assert_all_released

pytestmark = pytest.mark.timeout(600)

def my_context():
    from rayslice import get_step_context

    return dataclasses.asdict(get_step_context())


def test_a_step_submitted_as_a_job_gets_the_clusters_checkpoint_root(cluster):
    from rayslice.client.submission import run_step_job

    sid = f"test-context-{time.time_ns()}"
    spec = StepSpec.for_function(my_context, request=AcceleratorRequest(resource="GPU", count=0.25),
                                 owner=Owner(submission_id=sid))
    context = asyncio.run(run_step_job(cluster.dashboard_url, spec, token=cluster.token, emit=lambda line: None))
    assert cluster.checkpoint_root.startswith("file://")
    assert context["checkpoint_dir"] == checkpoint_dir_for(cluster.checkpoint_root, Owner(submission_id=sid))
    assert (context["try_number"], context["preemption_attempt"], context["process_index"]) == (0, 0, 0)


def test_every_host_knows_its_place_and_shares_the_tasks_folder(ray_driver, tmp_path):
    owner = Owner(dag_id="ctx", run_id="manual__1", task_id="train", map_index=2, try_number=3, ti_id="t",
                  submission_id=f"test-ctx-{time.time_ns()}")
    spec = StepSpec.for_function(my_context, request=TpuSliceRequest(tpu="v6e-16"), owner=owner,
                                 checkpoint_root=f"file://{tmp_path}")
    hosts = run_step(spec)
    folder = checkpoint_dir_for(f"file://{tmp_path}", owner)
    assert [(h["worker_id"], h["process_index"], h["num_processes"]) for h in hosts] == [(w, w, 4) for w in range(4)]
    assert {(h["checkpoint_dir"], h["try_number"], h["map_index"], h["dag_id"]) for h in hosts} == {
        (folder, 3, 2, "ctx")
    }
    assert folder.endswith("/ctx/manual__1/train/map-2")
    assert_all_released(ray_driver)


def _step_folder(root, step: int, written: float) -> None:
    import os

    folder = root / str(step)
    folder.mkdir(parents=True)
    (folder / "state").write_text("x")
    os.utime(folder / "state", (written, written))


def test_the_newest_complete_checkpoint_says_when_it_was_written(tmp_path):
    from rayslice.cluster import checkpoints

    assert checkpoints.newest_written(tmp_path.as_uri()) is None
    assert checkpoints.newest_written((tmp_path / "missing").as_uri()) is None
    _step_folder(tmp_path, 10, 1_000.0)
    _step_folder(tmp_path, 20, 2_000.0)
    (tmp_path / "30.orbax-checkpoint-tmp-1").mkdir()  # unfinished: not a checkpoint
    assert checkpoints.newest_written(tmp_path.as_uri()) == 2_000.0


def test_a_preempted_attempt_loses_the_work_after_its_newest_checkpoint(tmp_path):
    """The preempted hosts' reports died with them: the checkpoint folder says where the resume starts."""
    from rayslice.cluster import _note_lost_work
    from rayslice.cluster.phases import Timeline
    from rayslice.core.goodput import HELD, attempt_account

    timeline = Timeline()
    timeline.mark("reserved", at=90.0)
    timeline.note("actors_started", at=100.0)
    timeline.note("gang_returned", at=200.0)
    timeline.mark("released", at=201.0)
    timeline.chips, timeline.outcome = 16, "preempted"
    _step_folder(tmp_path, 7, 50.0)  # an earlier attempt's: everything of this one is lost
    _note_lost_work(timeline, tmp_path.as_uri())
    assert timeline.spans == {}
    assert attempt_account(timeline.record()).seconds["lost"] == 100.0
    _step_folder(tmp_path, 8, 170.0)  # this attempt saved at 170: 30 s lost
    _note_lost_work(timeline, tmp_path.as_uri())
    account = attempt_account(timeline.record())
    assert timeline.spans == {"lost": [[170.0, 200.0]]} and account.seconds["lost"] == 30.0
    assert account.seconds["productive"] == 70.0 and account.seconds["startup"] == 10.0
    assert sum(account.chip_s[c] for c in HELD) == account.held_chip_s == 111.0 * 16


def test_the_clusters_relative_file_checkpoint_root_is_refused_as_the_step_starts(monkeypatch):

    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-4"), command=["true"])
    monkeypatch.setenv(CHECKPOINT_ROOT_ENV, "file://ckpt")
    with pytest.raises(InvalidRequestError, match=f"the cluster's {CHECKPOINT_ROOT_ENV} must be a URL"):
        _checkpoint_dir(spec)
    monkeypatch.setenv(CHECKPOINT_ROOT_ENV, "file:///shared/ckpt")
    assert _checkpoint_dir(spec).startswith("file:///shared/ckpt/")


def test_a_suspended_attempt_that_saved_as_its_body_stopped_lost_nothing_after_the_save(tmp_path):
    """Issue 49's day: the hosts' exit after the notice's save (JAX shutdown, the gang's return) is redone by no
    one, so the lost span ends where the body stopped on every host (their `step_done`), not at the gang's return;
    the seconds after it are teardown."""
    from rayslice.cluster import _note_lost_work
    from rayslice.cluster.phases import Timeline
    from rayslice.core.goodput import attempt_account

    timeline = Timeline()
    timeline.mark("reserved", at=90.0)
    timeline.mark("step_started", at=100.0)
    timeline.mark("step_done", at=170.5)  # the body raised StepSuspended right after its save
    timeline.note("gang_returned", at=171.0)
    timeline.mark("released", at=172.0)
    timeline.chips, timeline.outcome = 16, "preempted"
    _step_folder(tmp_path, 8, 170.0)  # saved at the notice
    _note_lost_work(timeline, tmp_path.as_uri())
    assert timeline.spans == {"lost": [[170.0, 170.5]]}
    assert attempt_account(timeline.record()).seconds["lost"] == 0.5
