"""What the task log says when a preemption notice suspended a step: what happened, its place, where it resumes."""

from __future__ import annotations

from rayslice.cluster import suspend
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.exceptions import SuspendedError
from rayslice.core.step import StepSpec


def test_the_requeue_line_names_the_notice_the_original_arrival_the_priority_and_the_checkpoint(tmp_path):
    for step in ("4", "5", "5.orbax-checkpoint-tmp-1"):
        (tmp_path / step).mkdir()
    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), command=["true"], priority=3, preemption_retries=2)
    error = SuspendedError("suspended by a preemption notice (node ab12 (host v6e-16-a/host2) is being drained for "
                           "preemption); the step stopped for it")
    error.slice_name = "v6e-16-a"
    line = suspend.requeued(spec, error, arrival=0.0, number=1, checkpoint_dir=f"file://{tmp_path}")
    assert line.startswith("suspended by a preemption notice (node ab12")
    assert "original arrival (00:00:00 UTC) and priority 3" in line
    assert f"resumes from the checkpoint of step 5 in file://{tmp_path}" in line
    assert "(not on v6e-16-a, whose node is going)" in line
    assert "resumption 1 of 2 (preemption_retries), no Airflow retry" in line


def test_a_folder_without_a_checkpoint_resumes_from_the_start_and_the_queue_marker_keeps_only_the_why(tmp_path):
    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), command=["true"], preemption_retries=1)
    line = suspend.requeued(spec, SuspendedError("suspended by a preemption notice (x); y"), 0.0, 1, f"file://{tmp_path}")
    assert "resumes from the start" in line and "priority 0" in line
    assert suspend.marker_text("suspended by a preemption notice (suspended for d.eval (priority 10)); the step "
                               "stopped for it") == "suspended for d.eval (priority 10)"
    assert len(suspend.marker_text("x" * 500)) == 160
