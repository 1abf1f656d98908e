"""A preemption notice as a step sees it: `get_step_context().preempted`, its deadline, callbacks, the notice file."""

from __future__ import annotations

import threading
import time

import pytest

from rayslice.core import context as ctx
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.context import NOTICE_FILE_ENV, PreemptionNotice, StepContext
from rayslice.core.step import StepSpec


def a_context() -> StepContext:
    return StepContext(dag_id="d", run_id="r", task_id="t", map_index=-1, try_number=1, submission_id="s",
                       preemption_attempt=0, slice_index=0, slice_name="v6e-16-a", worker_id=0, process_index=0,
                       num_processes=4, checkpoint_dir=None)


@pytest.fixture
def running_step():
    context = a_context()
    ctx.set_step_context(context)
    yield context
    ctx.set_step_context(None)


def test_a_function_step_sees_no_notice_until_one_is_delivered_then_the_flag_and_deadline(running_step):
    assert not running_step.preempted and running_step.preemption_notice is None
    notice = PreemptionNotice(deadline=time.time() + 30, reason="node abc is being drained for preemption", node="abc")
    ctx.deliver_notice(notice)
    assert ctx.get_step_context().preempted
    assert running_step.preemption_notice == notice
    assert 0 < running_step.preemption_notice.seconds_left <= 30


def test_callbacks_run_once_when_the_notice_comes_and_at_once_when_registered_after_it(running_step):
    seen: list[PreemptionNotice] = []
    called = threading.Event()

    def callback(notice: PreemptionNotice) -> None:
        seen.append(notice)
        called.set()

    running_step.on_preemption(callback)
    assert not called.wait(0.2)
    notice = PreemptionNotice(deadline=time.time() + 30, reason="drained")
    ctx.deliver_notice(notice)
    ctx.deliver_notice(PreemptionNotice(deadline=time.time() + 5, reason="a second one is ignored"))
    assert called.wait(5)
    late = threading.Event()
    running_step.on_preemption(lambda n: (seen.append(n), late.set()))
    assert late.wait(5)
    assert seen == [notice, notice]


def test_the_next_step_in_the_same_process_starts_without_the_last_ones_notice(running_step):
    ctx.deliver_notice(PreemptionNotice(deadline=time.time() + 30, reason="drained"))
    ctx.set_step_context(None)
    ctx.set_step_context(a_context())
    assert not ctx.get_step_context().preempted


def test_a_command_step_reads_the_notice_file_its_host_writes(tmp_path, monkeypatch):
    path = tmp_path / "notice.json"
    monkeypatch.setattr(ctx, "_current", None)
    for key, value in {**a_context().to_env(), NOTICE_FILE_ENV: str(path)}.items():
        monkeypatch.setenv(key, value)
    context = ctx.get_step_context()
    assert not context.preempted
    heard = threading.Event()
    context.on_preemption(lambda notice: heard.set())
    path.write_text('{"deadline": 1')  # half-written: not a notice yet
    assert not context.preempted
    notice = PreemptionNotice(deadline=time.time() + 30, reason="drained", node="n1")
    path.write_text(notice.to_json())
    assert context.preemption_notice == notice
    assert heard.wait(5)
    ctx._notices.reset()


@pytest.mark.parametrize(("given", "kept"), [("SIGTERM", "SIGTERM"), ("usr1", "SIGUSR1"), ("None", "none"),
                                              ("SIGINT", "SIGINT")])
def test_a_command_steps_notice_signal_is_a_catchable_signal_or_none(given, kept):
    assert StepSpec(request=TpuSliceRequest(tpu="v6e-16"), command=["true"], notice_signal=given).notice_signal == kept


@pytest.mark.parametrize("given", ["SIGKILL", "SIGSTOP", "SIGNOPE", "15", ""])
def test_a_notice_signal_that_a_program_cannot_catch_is_refused_naming_the_argument(given):
    with pytest.raises(ValueError, match="notice_signal"):
        StepSpec(request=TpuSliceRequest(tpu="v6e-16"), command=["true"], notice_signal=given)
