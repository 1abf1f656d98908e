"""The launcher gives back what it holds when it is interrupted between taking capacity and running the hosts.

An Airflow kill (on_kill stops the Ray job: an interrupt in its driver) or a failure can land at any line; from the
moment a slice is reserved the release must already be armed. The notice watch's start (a thread) once ran
outside the release's reach. (A fraction's actor needs no such test: Ray ends it with its last handle.)
"""

from __future__ import annotations

import time

import pytest

from rayslice.cluster import notices
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from tests.conftest import TOTAL_TPU_CHIPS, wait_until
from tests.rayslice.cluster.test_launcher import our_placement_groups


def _step() -> str:
    return "ran"


class Interrupted(BaseException):
    """What an interrupt looks like to the launcher: not an Exception, so nothing on the way catches it."""


@pytest.fixture
def watch_start_interrupted(monkeypatch):
    def interrupted(self):
        raise Interrupted("the job was stopped while the notice watch started")

    monkeypatch.setattr(notices.Watch, "__enter__", interrupted)


def _run(request, **fields):
    from rayslice.cluster import run_step

    spec = StepSpec.for_function(_step, request=request, owner=Owner(submission_id=f"test-{time.time_ns()}"),
                                 **fields)
    return run_step(spec)


def test_a_slice_step_interrupted_as_its_watch_starts_releases_its_slice(ray_driver, watch_start_interrupted):
    with pytest.raises(Interrupted):
        _run(TpuSliceRequest(tpu="v6e-4"))
    assert wait_until(lambda: ray_driver.available_resources().get("TPU") == TOTAL_TPU_CHIPS, timeout=5.0), (
        ray_driver.available_resources().get("TPU"))
    assert our_placement_groups(ray_driver) == []
