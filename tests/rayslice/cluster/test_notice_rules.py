"""What a preemption notice does to a running gang, without a cluster (issue 39's review).

`run_gang` and the driver's `Watch` are driven with a stand-in for `ray` (results ready at once, or
never), the KV store a dict; a command step's notice runs real programs through `commands.run`.
Each test is a way the first build lost a checkpoint, a result or the slice.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import textwrap
import threading
import time
import types

import pytest
from ray.exceptions import RayActorError, RayTaskError

from rayslice import StepSuspended
from rayslice.cluster import commands, gang, host_loss, host_process, notices
from rayslice.cluster.environments import HostPlan
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.context import NOTICE_FILE_ENV, PreemptionNotice
from rayslice.core.exceptions import CapacityTimeoutError, InvalidRequestError, StepFailedError, SuspendedError
from rayslice.core.queue import QueueSettings
from rayslice.core.step import StepSpec

HANG = object()  # a host that never returns


class FakeRay:
    """`ray.wait`/`get`/`kill` over results known in advance; records every wait's timeout."""

    def __init__(self) -> None:
        self.waits: list[float | None] = []

    def wait(self, pending, num_returns=1, timeout=None):
        self.waits.append(timeout)
        ready = [r for r in pending if r.outcome is not HANG][:num_returns]
        return ready, [r for r in pending if r not in ready]

    def get(self, ref):
        if isinstance(ref.outcome, RayActorError):  # the host's process or node died
            raise ref.outcome
        if isinstance(ref.outcome, BaseException):
            raise RayTaskError("run", "Traceback: ...", ref.outcome)
        return ref.outcome if isinstance(ref.outcome, tuple) else (ref.outcome, {})

    def kill(self, actor, no_restart=True):
        pass

    dead: frozenset = frozenset()

    def nodes(self):
        return [{"NodeID": f"node{i}", "Alive": f"node{i}" not in self.dead} for i in range(4)]


class Ref:
    def __init__(self, outcome) -> None:
        self.outcome = outcome


def _actor(outcome):
    ref = Ref(outcome)
    return types.SimpleNamespace(run=types.SimpleNamespace(remote=lambda *a: ref))


def _plans(n):
    return [HostPlan(slice_index=0, slice_name="v6e-16-a", worker_id=i, ip=f"10.0.0.{i}", process_id=i,
                     num_processes=1, coordinator="", megascale_coordinator="", node_id=f"node{i}")
            for i in range(n)]


COMMAND = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), command=["python", "train.py"], hang_timeout=None,
                   preemption_retries=1)
FUNCTION = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), callable="train:fit", hang_timeout=None,
                    preemption_retries=1)


@pytest.fixture
def fake(monkeypatch, kv):
    ray = FakeRay()
    monkeypatch.setattr(gang, "ray", ray)
    monkeypatch.setattr(host_loss, "ray", ray)  # the host a failure is blamed on
    return ray


def _noticed(seconds_left: float) -> notices.Watch:
    watch = notices.Watch("k", {"node0": "v6e-16-a/host0"})
    watch.publish(PreemptionNotice(deadline=time.time() + seconds_left, reason="node0 is being drained", node="node0"))
    return watch


def _run(spec, outcomes, watch):
    return gang.run_gang([_actor(o) for o in outcomes], _plans(len(outcomes)), spec, host_process.Attempt(), None,
                         watch)


HEARD = {host_process.NOTICE_HEARD_KEY: 1.0}  # the host's report: the notice reached its program while it ran


def test_a_program_that_saves_and_exits_0_on_the_notice_is_suspended_not_done(fake):
    """MaxText's preemption path ends in `sys.exit()` (status 0) with no result written: unfinished, not done."""
    with pytest.raises(SuspendedError, match="the step stopped for it"):
        _run(COMMAND, [(None, HEARD), (None, HEARD)], _noticed(30))


def test_a_program_that_ended_before_the_notice_reached_it_is_done(fake):
    """Second review: a notice published after the program exited 0 (its host's report names no notice heard)."""
    assert _run(COMMAND, [None, None], _noticed(30)) == [None, None]


def test_a_program_that_writes_its_result_after_a_notice_and_a_function_that_returns_are_done(fake, capsys):
    assert _run(COMMAND, [{"loss": 0.1}, None], _noticed(30)) == [{"loss": 0.1}, None]
    assert _run(FUNCTION, [1, 1], _noticed(30)) == [1, 1]
    assert "returned after a preemption notice: its value is taken" in capsys.readouterr().out


def test_a_body_that_already_returned_is_kept_when_the_driver_looks_after_the_stop_time(fake):
    watch = _noticed(-10)  # the stop is due at once (a notice heard late)
    watch.noticed_at -= notices.MIN_GRACE_S
    assert _run(COMMAND, [{"done": True}], watch) == [{"done": True}]


def test_a_step_suspended_without_a_notice_is_a_plain_failure_not_a_free_retry(fake):
    with pytest.raises(StepFailedError) as info:
        _run(FUNCTION, [StepSuspended("no notice came")], notices.Watch("k", {"node0": "h"}))
    assert not isinstance(info.value, SuspendedError)


def test_peers_stuck_after_one_host_stopped_for_the_notice_hold_the_slice_a_minute_not_until_the_deadline(fake):
    """A one-hour maintenance notice: host 0 saved and stopped, host 1 sits in a collective it left."""
    with pytest.raises(SuspendedError):
        _run(FUNCTION, [StepSuspended("saved"), HANG], _noticed(3600))
    assert max(t for t in fake.waits if t is not None) <= gang.PEERS_STOP_S


def test_a_hosts_real_error_after_a_notice_stays_in_the_suspension(fake):
    with pytest.raises(SuspendedError) as info:
        _run(FUNCTION, [ZeroDivisionError("the real bug")], _noticed(3600))
    assert "the real bug" in str(info.value)
    assert isinstance(info.value.__cause__, StepFailedError)


@pytest.fixture
def drained(monkeypatch, kv):
    """Node id -> drain deadline, as the GCS lists it (empty: nothing draining yet)."""
    nodes: dict[str, float] = {}
    monkeypatch.setattr(notices, "draining", lambda wanted: dict(nodes))
    return nodes


@contextlib.contextmanager
def _priority_noticed():
    """A Watch over node0 that has heard the queue's priority notice (30 s of grace)."""
    with notices.Watch("k", {"node0": "v6e-16-a/host0"}, poll=0.02,
                       requested=lambda: ("suspended for d.eval (priority 10)", 30.0)) as watch:
        assert _until(lambda: watch.notice is not None)
        yield watch


def test_a_drain_with_an_earlier_deadline_after_a_priority_notice_moves_the_stop_and_names_the_node(drained):
    with _priority_noticed() as watch:
        assert watch.notice.node == ""
        deadline = time.time() + 10
        drained["node0"] = deadline
        assert _until(lambda: watch.notice.node == "node0")
        assert watch.stop_at() == pytest.approx(deadline - notices.STOP_MARGIN_S)


def test_a_deadline_already_past_on_this_clock_still_leaves_the_step_its_minimum_grace(monkeypatch, kv):
    """The drainer's clock 40 s ahead of the driver's: a 30 s notice reads as expired 10 s ago."""
    monkeypatch.setattr(notices, "draining", lambda nodes: {"node0": time.time() - 10})
    with notices.Watch("k", {"node0": "v6e-16-a/host0"}, poll=0.02) as watch:
        assert _until(lambda: watch.notice is not None)
        assert watch.stop_at() == pytest.approx(watch.noticed_at + notices.MIN_GRACE_S)


def test_a_notice_the_gcs_refused_once_still_reaches_the_hosts(monkeypatch, kv):
    calls = []

    def flaky_put(key, value, namespace=None, **kw):
        calls.append(key)
        if len(calls) == 1:
            raise ConnectionError("GCS unavailable")
        kv[key] = value

    monkeypatch.setattr(notices.internal_kv, "_internal_kv_put", flaky_put)
    monkeypatch.setattr(notices, "draining", lambda nodes: {"node0": time.time() + 30})
    with notices.Watch("k", {"node0": "v6e-16-a/host0"}, poll=0.02) as watch:
        assert _until(lambda: "k" in kv), "the hosts' key was never written"
        assert watch.notice is not None


def _until(condition, timeout=3.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return False


SAVER = textwrap.dedent("""
    import signal, sys, time
    def on_term(*_):
        time.sleep(1.5)                      # the emergency checkpoint takes a moment
        open(sys.argv[1], "w").write("saved")
        sys.exit(75)
    signal.signal(signal.SIGTERM, on_term)
    open(sys.argv[1] + ".ready", "w").close()
    print("training", flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("wrapped", [False, True], ids=["python", "bash-wrapper"])
def test_a_programs_checkpoint_on_sigterm_is_saved_even_behind_a_shell_wrapper(tmp_path, wrapped):
    """`command=["bash", "train.sh"]`: bash dies of the group's SIGTERM at once; its Python child still saves."""
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    saved = tmp_path / "saved"
    argv = ["python", str(script), str(saved)]
    if wrapped:
        (tmp_path / "train.sh").write_text(f"echo preflight\n{' '.join(argv)}\necho done\n")
        argv = ["bash", str(tmp_path / "train.sh")]
    report = tempfile.mkdtemp(dir=tmp_path)
    notice = notices.CommandNotice(os.path.join(report, "notice.json"), "SIGTERM")
    ended: dict = {}

    def run() -> None:
        try:
            ended["result"] = commands.run(argv, {**os.environ, NOTICE_FILE_ENV: notice.path}, report,
                                           on_start=notice.started, on_end=notice.program_ended)
        except commands.CommandExitError as exc:
            ended["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    assert _until(lambda: os.path.exists(f"{saved}.ready"), timeout=30)  # its handler is in (a loaded machine)
    notice.deliver(PreemptionNotice(deadline=time.time() + 30, reason="test drain", node="n"))
    thread.join(20)
    assert saved.read_text() == "saved", ended
    assert "error" in ended  # killed by the signal (bash) or exit 75: the gang reads a suspension


def test_a_preemptible_step_needs_a_preemption_retry_to_resume_with():
    with pytest.raises(ValueError, match="preemptible=True needs preemption_retries of at least 1"):
        StepSpec(request=TpuSliceRequest(tpu="v6e-16"), command=["true"], preemptible=True)
    from rayslice.operators.tpu_slice import TpuSliceOperator

    with pytest.raises(InvalidRequestError, match="task 'train'"):
        TpuSliceOperator(task_id="train", tpu="v6e-16", command=["true"], preemptible=True)


def test_a_grace_shorter_than_the_launchers_stop_margin_is_refused():
    with pytest.raises(ValueError, match="preemption_grace_s"):
        QueueSettings.checked({"preemption": "lower-priority", "preemption_grace_s": 1}, "RAYSLICE_QUEUE")


class _Place:
    """An admission place that is admitted at once and records what the launcher asked of the queue."""

    def __init__(self, asked: list, waits: list, preemptible: bool) -> None:
        self.asked, self.waits, self.suspend = asked, waits, None
        self.entry = types.SimpleNamespace(part=False, preemptible=preemptible)
        asked.append(preemptible)

    def join(self):
        self.admitted = types.SimpleNamespace(is_set=lambda: True)
        return self

    def wait(self, timeout):
        self.waits.append(timeout)
        return 0.0

    def leave(self):
        pass


def test_a_suspended_step_waits_its_whole_capacity_timeout_again_and_is_no_victim_without_a_retry_left(monkeypatch):
    """Before: the requeued step had only what its first wait left of capacity_timeout, and a step on its
    last resumption was still offered as a priority victim (its suspension would fail the task)."""
    import rayslice.cluster as launcher

    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), command=["true"], preemption_retries=1,
                    preemptible=True, capacity_timeout=600)
    asked, waits_seen, runs = [], [], []

    def reserve_and_run(spec, request, attempt, timeline, waits, name, started, place):
        runs.append(1)
        if len(runs) == 1:
            error = SuspendedError("suspended by a preemption notice (suspended for d.eval (priority 10)); stopped")
            error.node_id, error.slice_name, error.stopped_at_deadline = "", "", False
            raise error
        return ["done"]

    monkeypatch.setattr(launcher, "check_satisfiable", lambda *a, **k: set())
    monkeypatch.setattr(launcher.admission, "place_for",
                        lambda spec, arrival=None, preemptible=None, **_:
                        _Place(asked, waits_seen, preemptible))
    monkeypatch.setattr(launcher, "_reserve_and_run_on_slices", reserve_and_run)
    monkeypatch.setattr(launcher.metrics.sender, "attempt", lambda *a, **k: None)
    waits = launcher.Waits(capacity=5.0, start=1.0)  # as if the first wait had used most of both budgets
    assert launcher._attempts(spec, launcher.phases.Timeline(), None, waits, [], None) == ["done"]
    assert waits_seen == [5.0, 600.0]
    assert asked == [True, False]


def test_a_preemptible_gpu_fraction_hears_the_queues_word_as_a_notice(monkeypatch):
    """The broker may choose a GPU step as a victim: its launcher must turn that into a notice, as a slice's does."""
    import rayslice.cluster as launcher

    spec = StepSpec(request=AcceleratorRequest(resource="GPU", count=1), command=["true"], preemption_retries=1,
                    preemptible=True)
    place = _Place([], [], True)
    place.suspend = ("suspended for d.urgent (priority 10)", 30.0)
    port = types.SimpleNamespace(remote=lambda: "port")
    actor = types.SimpleNamespace(free_port=port)
    monkeypatch.setattr(launcher.host_process.HostProcess, "options",
                        lambda **kw: types.SimpleNamespace(remote=lambda *a: actor), raising=False)
    monkeypatch.setattr(launcher.ray, "wait", lambda refs, timeout=None: (refs, []))
    monkeypatch.setattr(launcher, "_hosts_runtime_env", lambda spec, *nodes, **resource: launcher.HostsEnv(None, None))
    monkeypatch.setattr(launcher.gang, "kill", lambda actors: None)
    monkeypatch.setattr(notices.internal_kv, "_internal_kv_put", lambda *a, **k: None)
    monkeypatch.setattr(notices.internal_kv, "_internal_kv_del", lambda *a, **k: None)
    heard = {}

    def run_gang(actors, plans, spec, attempt, timeline, watch=None):
        heard["notice"] = _until(lambda: watch is not None and watch.notice is not None) and watch.notice.reason
        heard["key"] = attempt.notice_key == watch.key
        return ["done"]

    monkeypatch.setattr(launcher.gang, "run_gang", run_gang)
    result = launcher._place_and_run_fraction(spec, spec.request, launcher.host_process.Attempt(),
                                              launcher.phases.Timeline(), launcher.Waits(capacity=10, start=10),
                                              time.monotonic(), place)
    assert result == "done"
    assert heard == {"notice": "suspended for d.urgent (priority 10)", "key": True}


def test_a_suspended_attempts_hosts_that_linger_are_waited_for_before_the_step_resumes(monkeypatch, capsys):
    """Reviewer's case B: a host on a node cut off from the GCS is not reported dead within the first 10 s."""
    import rayslice.cluster as launcher

    asked = []
    monkeypatch.setattr(launcher.gang, "wait_dead",
                        lambda actors, timeout=10.0: asked.append(timeout) or (actors if len(asked) == 1 else []))
    launcher._wait_for_hosts_to_end(["host0", "host1"])
    assert asked == [10.0, launcher.HOSTS_END_S]
    assert "have not ended yet" in capsys.readouterr().out


FINISHER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    # a helper in its own session that outlives the program (a log shipper, tensorboard)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    with open(os.environ["RAYSLICE_RESULT_FILE"], "w") as f:
        json.dump({"done": True}, f)
    time.sleep(1.5)   # the notice comes now, while it runs; it finishes anyway
""")


def test_a_program_that_finishes_after_the_notice_is_not_held_for_its_background_child(tmp_path):
    """Second review: the program wrote its result and exited 0; its detached child must not keep the host."""
    script = tmp_path / "finisher.py"
    script.write_text(FINISHER)
    report = tempfile.mkdtemp(dir=tmp_path)
    notice = notices.CommandNotice(os.path.join(report, "notice.json"), "none")
    ended: dict = {}

    def run() -> None:
        ended["result"] = commands.run(["python", str(script)], {**os.environ, NOTICE_FILE_ENV: notice.path}, report,
                                       on_start=notice.started, on_end=notice.program_ended)
        ended["at"] = time.monotonic()

    started = time.monotonic()
    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.8)
    notice.deliver(PreemptionNotice(deadline=time.time() + 30, reason="test drain", node="n"))
    thread.join(30)
    assert ended["result"] == {"done": True}
    assert ended["at"] - started < 10, "the host waited for the program's background child"
    assert notice.heard_at is not None


def test_a_notice_that_comes_after_the_program_ended_is_not_delivered_to_it(tmp_path):
    notice = notices.CommandNotice(str(tmp_path / "notice.json"), "SIGTERM")
    notice.started(os.getpid() + 10_000_000)  # no such process group
    assert notice.program_ended(0) is None
    notice.deliver(PreemptionNotice(deadline=time.time() + 30, reason="late", node="n"))
    assert notice.heard_at is None and not (tmp_path / "notice.json").exists()


def test_a_wrapped_programs_save_gets_the_minimum_grace_even_past_the_deadline_and_at_most_a_minute(tmp_path):
    notice = notices.CommandNotice(str(tmp_path / "notice.json"), "none")
    notice.deliver(PreemptionNotice(deadline=time.time() - 10, reason="skewed clock", node="n"))
    assert notice.program_ended(-15) == pytest.approx(notice.heard_at + notices.MIN_GRACE_S, abs=0.5)
    later = notices.CommandNotice(str(tmp_path / "notice2.json"), "none")
    later.deliver(PreemptionNotice(deadline=time.time() + 3600, reason="maintenance", node="n"))
    assert later.program_ended(75) == pytest.approx(time.time() + notices.LINGER_S, abs=0.5)
    assert later.program_ended(0) is None  # finished: nothing to wait for


def test_a_later_drain_after_a_priority_notice_keeps_the_stop_and_names_the_node(drained):
    """Second review: an hour-ahead maintenance drain must not push a 30 s priority stop an hour later."""
    with _priority_noticed() as watch:
        stop = watch.stop_at()
        drained["node0"] = time.time() + 3600
        assert _until(lambda: watch.notice.node == "node0")
        assert watch.stop_at() == pytest.approx(stop)


def test_a_fraction_that_is_not_preemptible_listens_for_no_notice(monkeypatch):
    import rayslice.cluster as launcher

    spec = StepSpec(request=AcceleratorRequest(resource="GPU", count=0.5), command=["true"])
    place = _Place([], [], False)
    actor = types.SimpleNamespace(free_port=types.SimpleNamespace(remote=lambda: "port"))
    monkeypatch.setattr(launcher.host_process.HostProcess, "options",
                        lambda **kw: types.SimpleNamespace(remote=lambda *a: actor), raising=False)
    monkeypatch.setattr(launcher.ray, "wait", lambda refs, timeout=None: (refs, []))
    monkeypatch.setattr(launcher, "_hosts_runtime_env", lambda spec, *nodes, **resource: launcher.HostsEnv(None, None))
    monkeypatch.setattr(launcher.gang, "kill", lambda actors: None)
    seen = {}
    monkeypatch.setattr(launcher.gang, "run_gang", lambda actors, plans, spec, attempt, timeline, watch=None:
                        seen.update(watch=watch, key=attempt.notice_key) or ["done"])
    launcher._place_and_run_fraction(spec, spec.request, launcher.host_process.Attempt(), launcher.phases.Timeline(),
                                     launcher.Waits(capacity=10, start=10), time.monotonic(), place)
    assert seen == {"watch": None, "key": ""}


def test_a_stored_setting_that_todays_rules_refuse_drops_only_itself(monkeypatch, capsys):
    """Second review: a grace of 5 s stored before the 10 s minimum must not take the quotas with it."""
    from rayslice.cluster import queue

    stored = {"preemption": "lower-priority", "preemption_grace_s": 5, "quotas": {"a": {"v6e-16": 16}}}
    monkeypatch.setattr(queue, "_kv_get", lambda key: json.dumps(stored).encode())
    settings = queue.operator_settings()
    assert settings.preemption == "lower-priority" and settings.quotas == {"a": {"v6e-16": 16}}
    assert settings.preemption_grace_s == QueueSettings().preemption_grace_s
    assert "preemption_grace_s ignored" in capsys.readouterr().out


# ---- Issue 49, finding 3: one rule for a notice's end (docs/preemption.md "How a step's end is read")


def _watch(seconds_left: float, resumable: bool) -> notices.Watch:
    watch = notices.Watch("k", {"node0": "v6e-16-a/host0"}, resumable=resumable)
    watch.publish(PreemptionNotice(deadline=time.time() + seconds_left, reason="node0 is being drained", node="node0"))
    return watch


def test_with_no_resumption_left_a_far_notice_is_held_back_from_the_hosts_and_a_near_one_is_not(fake, kv):
    """Suspending a step that cannot resume fails it: the hosts hear the notice only for a last checkpoint."""
    far = _watch(3600, resumable=False)
    assert "k" not in kv and far.heard() is None
    near = _watch(notices.LAST_CALL_S / 2, resumable=False)
    assert "k" in kv and near.heard() is near.notice
    kv.clear()
    assert _watch(3600, resumable=True).heard() is not None and "k" in kv  # resumable: told at once


def test_a_held_back_notice_reaches_the_hosts_at_its_last_call(kv):
    deadline = time.time() + notices.STOP_MARGIN_S + notices.LAST_CALL_S + 0.3
    with notices.Watch("k", {"node0": "h"}, poll=0.02, resumable=False) as watch:
        watch.publish(PreemptionNotice(deadline=deadline, reason="maintenance", node="node0"))
        assert "k" not in kv
        assert _until(lambda: "k" in kv), "the last call never came"
        assert time.time() >= watch.stop_at() - notices.LAST_CALL_S


@pytest.mark.parametrize("resumable", [True, False], ids=["retries-left", "none-left"])
def test_a_program_that_exits_0_without_being_sent_the_signal_has_finished(fake, resumable):
    """Before: with the default preemption_retries=0, a command that finished after a notice failed the step."""
    assert _run(COMMAND, [(None, {}), (None, {})], _watch(30, resumable)) == [None, None]


def test_with_no_resumption_left_a_hosts_error_under_a_held_back_notice_is_its_own_failure(fake):
    with pytest.raises(StepFailedError) as info:
        _run(FUNCTION, [ZeroDivisionError("the real bug")], _watch(3600, resumable=False))
    assert not isinstance(info.value, SuspendedError)


MAXTEXT = textwrap.dedent("""
    import signal, sys, time
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    open(sys.argv[1] + ".ready", "w").close()
    for step in range(600):
        if stop:                               # reached_preemption(step)
            open(sys.argv[1], "w").write(f"checkpoint {step}")
            sys.exit()                         # MaxText: status 0, no result, unfinished
        time.sleep(0.05)
    open(sys.argv[1], "w").write("finished")
""")

EXPORTER = textwrap.dedent("""
    import sys, time
    for row in range(3):                       # not idempotent: every run appends its rows again
        open(sys.argv[1], "a").write(f"row {row}\\n")
        time.sleep(0.4)
""")


def _host_run(tmp_path, argv: list[str], signal_name: str, deliver_after: float, notice_s: float = 30, ready=None):
    """One host's program under a notice: what `HostProcess.run` returns (its result, and its report).

    The notice comes `deliver_after` s after the start, or once `ready(report_dir)` holds (a loaded machine
    starts Python slowly).
    """
    report = tempfile.mkdtemp(dir=tmp_path)
    notice = notices.CommandNotice(os.path.join(report, "notice.json"), signal_name)
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = host_process.run_program(argv, {**os.environ, NOTICE_FILE_ENV: notice.path}, report, 0.0,
                                                     notice)
        except commands.CommandExitError as exc:
            out["result"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    if ready is None:
        time.sleep(deliver_after)
    else:
        assert _until(lambda: ready(report), timeout=30), "the program never got ready"
    notice.deliver(PreemptionNotice(deadline=time.time() + notice_s, reason="test drain", node="n"))
    thread.join(30)
    return out["result"]


@pytest.mark.parametrize("wrapped", [False, True], ids=["python", "bash-wrapper"])
def test_a_maxtext_like_program_that_saves_and_exits_0_on_the_signal_is_suspended(fake, tmp_path, wrapped):
    script, saved = tmp_path / "maxtext.py", tmp_path / "saved"
    script.write_text(MAXTEXT)
    argv = ["python", str(script), str(saved)]
    if wrapped:  # `exec` keeps the wrapper's pid: the program is the group's leader, as `exec python ...` is
        (tmp_path / "train.sh").write_text(f"echo preflight\nexec {' '.join(argv)}\n")
        argv = ["bash", str(tmp_path / "train.sh")]
    host = _host_run(tmp_path, argv, "SIGTERM", deliver_after=0,
                     ready=lambda report: os.path.exists(f"{saved}.ready"))
    assert saved.read_text().startswith("checkpoint"), host
    with pytest.raises(SuspendedError, match="the step stopped for it"):
        _run(COMMAND, [host], _watch(30, resumable=True))


@pytest.mark.parametrize("wrapped", [False, True], ids=["python", "bash-wrapper"])
def test_an_exporter_that_finishes_under_a_notice_is_done_and_not_run_again(fake, tmp_path, wrapped):
    """notice_signal="none": the exporter runs on to its end (exit 0, no result file); with a retry left it
    must not be suspended (its resumption would write every row again)."""
    script, rows = tmp_path / "export.py", tmp_path / "rows"
    script.write_text(EXPORTER)
    argv = ["python", str(script), str(rows)]
    if wrapped:
        (tmp_path / "export.sh").write_text(f"echo preflight\n{' '.join(argv)}\necho exported\n")
        argv = ["bash", str(tmp_path / "export.sh")]
    host = _host_run(tmp_path, argv, "none", deliver_after=0,
                     ready=lambda report: rows.exists())  # the notice comes while it writes
    assert _run(COMMAND, [host], _watch(30, resumable=True)) == [None]
    assert rows.read_text().count("row 0") == 1


def test_a_program_that_wrote_its_result_and_then_died_of_the_notice_signal_has_finished(fake, tmp_path):
    """The race an exporter cannot avoid: its result is written, and the signal kills it on its way out."""
    script = tmp_path / "late.py"
    script.write_text(textwrap.dedent("""
        import json, os, time
        with open(os.environ["RAYSLICE_RESULT_FILE"] + ".tmp", "w") as f:
            json.dump({"rows": 3}, f)
        os.replace(os.environ["RAYSLICE_RESULT_FILE"] + ".tmp", os.environ["RAYSLICE_RESULT_FILE"])
        time.sleep(30)                         # exiting: no handler, SIGTERM ends it
    """))
    host = _host_run(tmp_path, ["python", str(script)], "SIGTERM", deliver_after=0,
                     ready=lambda report: os.path.exists(os.path.join(report, "result.json")))
    assert not isinstance(host, BaseException), host
    assert _run(COMMAND, [host], _watch(30, resumable=True)) == [{"rows": 3}]


# ---- Issue 49, findings 4, 6, 9, 10: notices that come while a step starts, loses a host, or times out


def _starting(n: int):
    """Host actors whose process never starts (a runtime env still installing)."""
    ref = Ref(HANG)
    return [types.SimpleNamespace(free_port=types.SimpleNamespace(remote=lambda: ref)) for _ in range(n)]


def test_a_notice_while_the_hosts_start_suspends_the_step_at_once_not_after_its_start_up(fake, monkeypatch):
    """Before: `await_started` never looked at the notice; a victim kept the slice up to 300 s of start-up."""
    monkeypatch.setattr(gang.node_probe, "raylet_unreachable", lambda node: False)
    with pytest.raises(SuspendedError, match="still starting"):
        gang.await_started(_starting(2), _plans(2), timeout=2.0, watch=_watch(30, resumable=True))
    assert all(t is not None and t <= notices.POLL_S for t in fake.waits)


def test_a_drained_node_that_dies_while_the_hosts_start_is_a_suspension_that_avoids_its_slice(fake):
    """Before: a plain PreemptedError (the retry started with what the first waits had left)."""
    fake.dead = frozenset({"node1"})
    with pytest.raises(SuspendedError) as info:
        gang.await_started(_starting(2), _plans(2), timeout=2.0, watch=_watch(3600, resumable=False))
    assert (info.value.node_id, info.value.slice_name) in {("node0", "v6e-16-a"), ("node1", "v6e-16-a")}
    assert "node1" in {info.value.node_id, getattr(info.value, "also_lost", "")}


def test_a_host_lost_during_a_priority_notices_grace_is_recorded_so_the_resumption_avoids_it(fake, monkeypatch):
    """Before: the suspension named the notice's node (none, for a priority notice): the lost host was forgotten."""
    monkeypatch.setattr(host_loss, "node_died", lambda node_id, actor, within=0: True)
    with _priority_noticed() as watch:
        with pytest.raises(SuspendedError) as info:
            _run(FUNCTION, [StepSuspended("saved"), RayActorError()], watch)
    assert (info.value.node_id, info.value.slice_name) == ("node1", "v6e-16-a")


@pytest.mark.parametrize("expiring", ["step_timeout", "hang_timeout"])
def test_a_timeout_that_expires_while_the_step_stops_for_the_notice_is_a_suspension(fake, monkeypatch, expiring):
    """Before: StepTimeoutError or CollectiveHangError, a failed try, although the step was stopping for the notice."""
    spec = FUNCTION.model_copy(update={"step_timeout": 0.2})
    if expiring == "hang_timeout":
        spec = FUNCTION

        def hung(*args):
            raise gang.CollectiveHangError("collective hang: ...", slice_index=0, worker_id=0, host="h",
                                           cause="collective hang")
        monkeypatch.setattr(gang, "_check_hang", hung)
    with pytest.raises(SuspendedError, match=expiring):
        _run(spec, [HANG], _watch(3600, resumable=True))


def _fraction(monkeypatch, starts_on_wait: int | None, suspend=None, start_budget: float = 3.0):
    """Run a preemptible GPU fraction whose worker starts on this `ray.wait` (None: never), with `start_budget`
    seconds of host start budget (spent in full, in real time, by a worker that never starts)."""
    import rayslice.cluster as launcher

    spec = StepSpec(request=AcceleratorRequest(resource="GPU", count=0.5), command=["true"], preemption_retries=1,
                    preemptible=True, capacity_timeout=600)
    place = _Place([], [], True)
    place.suspend = suspend
    actor = types.SimpleNamespace(free_port=types.SimpleNamespace(remote=lambda: "port"))
    waited: list = []

    def wait(refs, timeout=None):
        waited.append(timeout)
        return (refs, []) if starts_on_wait is not None and len(waited) >= starts_on_wait else ([], refs)

    monkeypatch.setattr(launcher.host_process.HostProcess, "options",
                        lambda **kw: types.SimpleNamespace(remote=lambda *a: actor), raising=False)
    monkeypatch.setattr(launcher.ray, "wait", wait)
    monkeypatch.setattr(launcher, "_hosts_runtime_env", lambda spec, *nodes, **resource: launcher.HostsEnv(None, None))
    monkeypatch.setattr(launcher.gang, "kill", lambda actors: None)
    monkeypatch.setattr(launcher.gang, "wait_dead", lambda actors, timeout=0: [])
    monkeypatch.setattr(launcher.gang, "run_gang", lambda actors, plans, spec, attempt, timeline, watch=None: ["done"])
    monkeypatch.setattr(notices.internal_kv, "_internal_kv_put", lambda *a, **k: None)
    monkeypatch.setattr(notices.internal_kv, "_internal_kv_del", lambda *a, **k: None)
    waits = launcher.Waits(capacity=0.0, start=start_budget)  # the queue wait used all of capacity_timeout
    result = launcher._place_and_run_fraction(spec, spec.request, launcher.host_process.Attempt(),
                                              launcher.phases.Timeline(), waits, time.monotonic(), place)
    return result, waits


def test_an_admitted_fractions_worker_start_has_its_own_start_budget_not_what_the_queue_left(monkeypatch):
    """Before: admitted after nearly all of capacity_timeout, its worker had the few seconds left to start."""
    result, waits = _fraction(monkeypatch, starts_on_wait=2)
    assert result == "done"
    assert waits.start < 3.0  # the start was charged to its own budget


def test_a_fraction_whose_worker_never_starts_says_so_within_its_start_budget(monkeypatch):
    with pytest.raises(CapacityTimeoutError, match="did not start on a node within the 1 s left of the host start"):
        _fraction(monkeypatch, starts_on_wait=None, start_budget=1.0)


def test_a_fraction_whose_worker_is_still_starting_acts_on_the_queues_notice_at_once(monkeypatch):
    with pytest.raises(SuspendedError, match="still starting"):
        _fraction(monkeypatch, starts_on_wait=None, suspend=("suspended for d.urgent (priority 10)", 30.0))


class _NoDrain:
    """No host output to wait for (no Ray driver prints it here)."""

    QUIET_S = 0.0

    def explain_shutdown(self, labels, noticed):
        pass

    def wait(self, labels, quiet=0.0):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("resumptions_left", [1, 0])
def test_the_launcher_acts_on_a_notice_while_the_hosts_start_only_where_a_resumption_is_left(
        fake, monkeypatch, resumptions_left):
    """Finding 4 through `_reserve_and_run_on_slices`: a victim still starting frees its slice within the grace,
    and its capacity is released; with no resumption left an hour's drain notice lets it start and finish."""
    import rayslice.cluster as launcher

    plans = _plans(2)
    released = []
    reservation = types.SimpleNamespace(hosts=plans, hosts_group=None, bundles={(0, 0): 0, (0, 1): 1},
                                        release=lambda requeue=None: released.append(1) or [])
    polls = []  # the watch's looks at the GCS: the hosts start only once it has seen the drain

    class Started:
        @property
        def outcome(self):
            return HANG if resumptions_left or len(polls) < 2 else 0

    started = Started()
    actor = types.SimpleNamespace(free_port=types.SimpleNamespace(remote=lambda: started))
    monkeypatch.setattr(launcher, "reserve_slices", lambda *a, **k: reservation)
    monkeypatch.setattr(launcher.host_process.HostProcess, "options",
                        lambda **kw: types.SimpleNamespace(remote=lambda *a: actor), raising=False)
    monkeypatch.setattr(launcher, "_hosts_runtime_env", lambda spec, *nodes, **resource: launcher.HostsEnv(None, None))
    monkeypatch.setattr(launcher.gang, "wait_dead", lambda actors, timeout=0: [])
    monkeypatch.setattr(launcher.log_drain, "LogDrain", _NoDrain)
    monkeypatch.setattr(launcher.gang, "run_gang", lambda actors, plans, spec, attempt, timeline, watch=None: ["done"])
    monkeypatch.setattr(gang.node_probe, "raylet_unreachable", lambda node: False)
    monkeypatch.setattr(notices, "draining", lambda nodes: polls.append(1) or {"node0": time.time() + 3600})
    place = _Place([], [], True)
    place.grow = None
    spec = COMMAND.model_copy(update={"preemption_retries": resumptions_left})
    waits = launcher.Waits(capacity=10.0, start=5.0, resumptions_left=resumptions_left)

    def run():
        return launcher._reserve_and_run_on_slices(spec, spec.request, launcher.host_process.Attempt(),
                                                   launcher.phases.Timeline(), waits, "rayslice:t", time.monotonic(),
                                                   place)
    if resumptions_left:
        with pytest.raises(SuspendedError, match="still starting"):
            run()
        assert waits.start > 5.0 - 3.0, "it waited out its start-up, not the notice"
    else:
        assert run() == ["done"]
    assert released == [1]


def test_a_notice_held_back_from_the_hosts_leaves_their_jax_termination_a_real_failure_in_the_log(fake, kv):
    """The log drain explains a host's JAX termination only once the hosts were told: under a held-back
    notice (no resumption left, deadline far) such a line is the step's own failure and reaches the task log
    as it came; once told (a resumable step), it is the suspension's expected noise."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    from rayslice.cluster import log_drain, shutdown_noise

    line = "F1206 client.cc:101] Terminating process because the JAX distributed service detected fatal errors."
    for resumable, explained in ((False, False), (True, True)):
        watch = _watch(3600, resumable=resumable)
        printed: list[str] = []
        installed = any(name == "ray_print_logs" for name, _ in dispatcher.handlers)
        if not installed:
            dispatcher.add_handler("ray_print_logs", lambda data: None)
        dispatcher.add_handler("test-printed", lambda data, out=printed: out.extend(data["lines"]))
        drain = log_drain.LogDrain()
        drain.explain_shutdown({"v6e-16-a/host0"}, watch.hosts_stopping)
        try:
            dispatcher.emit({"actor_name": "v6e-16-a/host0", "pid": 1, "is_err": True, "lines": [line]})
        finally:
            drain.close()
            dispatcher.remove_handler("test-printed")
            if not installed:
                dispatcher.remove_handler("ray_print_logs")
        assert (line not in printed) is explained and (shutdown_noise.EXPLAINED in printed) is explained, (
            resumable, printed)
        kv.clear()


def test_a_victim_suspended_while_ray_places_its_slices_resumes_in_its_place(monkeypatch):
    """Review 2026-12-06 (4): the reservation now hears the queue's word while Ray places its slices; the launcher
    must then keep the step's place (requeue it for the next attempt), not leave the queue as after a failure."""
    import rayslice.cluster as launcher

    calls = []
    place = _Place([], [], True)
    place.requeue = lambda: calls.append("requeue") or place
    place.leave = lambda: calls.append("leave")

    def reserve(request, timeout, name, lost_nodes, place):
        error = SuspendedError("suspended by a preemption notice (suspended for d.urgent (priority 10)); Ray was "
                               "still placing its slices")
        error.node_id, error.slice_name, error.stopped_at_deadline = "", "", False
        raise error

    monkeypatch.setattr(launcher, "check_satisfiable", lambda *a, **k: set())
    monkeypatch.setattr(launcher, "_admit", lambda spec, waits, timeline, most_slices=None: place)
    monkeypatch.setattr(launcher, "reserve_slices", reserve)
    waits = launcher.Waits(capacity=10.0, start=5.0, resumptions_left=1)
    with pytest.raises(SuspendedError):
        launcher._run_on_slices(COMMAND, COMMAND.request, launcher.host_process.Attempt(), launcher.phases.Timeline(),
                                waits)
    assert calls == ["requeue"] and waits.requeued is place


# ---- Review of issue 49's rule (review-notice): a signal that reached no one running is no stop for it


def _zombie(argv: list[str]) -> int:
    """A program whose first process exited 0 and is not reaped yet (the host's wait thread not yet run)."""
    import subprocess

    child = subprocess.Popen(argv, start_new_session=True)
    assert _until(lambda: _state(child.pid) == "Z", timeout=30), "the program never exited"
    return child


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads Linux's /proc")
def test_a_notice_that_lands_after_the_program_exited_0_but_before_the_host_reaped_it_is_no_signal(tmp_path):
    """Before: `killpg` succeeds on a group whose leader is a zombie, so a program that had finished (exit 0, no
    result file) was reported as sent the signal: suspended and run again (retry left), or failed (none)."""
    child = _zombie(["true"])
    notice = notices.CommandNotice(str(tmp_path / "notice.json"), "SIGTERM")
    notice.started(child.pid)
    notice.deliver(PreemptionNotice(deadline=time.time() + 30, reason="in the reap window", node="n"))
    child.wait()
    assert notice.signalled_at is None and host_process.notice_report(notice) == {}


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads Linux's /proc")
def test_a_program_that_exited_0_leaving_a_child_in_its_group_was_not_signalled_by_a_later_notice(tmp_path):
    """The leader finished (exit 0) and was reaped; a helper it started (same process group) still runs as the
    notice lands. Before: the signal reached the helper, and the finished program read as stopped for it."""
    import signal
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                              "'import time; time.sleep(30)'])"], start_new_session=True)
    notice = notices.CommandNotice(str(tmp_path / "notice.json"), "SIGTERM")
    notice.started(child.pid)
    child.wait()
    try:
        notice.deliver(PreemptionNotice(deadline=time.time() + 30, reason="after its end", node="n"))
        assert notice.signalled_at is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)


IGNORING_WRAPPER = "trap '' TERM\n{program}\necho exported\n"


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads Linux's /proc")
def test_an_exporter_behind_a_wrapper_that_ignores_the_signal_finishes_and_is_not_run_again(fake, tmp_path):
    """`trap '' TERM` in the wrapper: every process of the program ignores SIGTERM (an ignored signal is inherited),
    so the exporter runs to its end and exits 0. Before: read as stopped for the notice, and resumed: every row
    written twice."""
    script, rows = tmp_path / "export.py", tmp_path / "rows"
    script.write_text(EXPORTER)
    wrapper = tmp_path / "export.sh"
    wrapper.write_text(IGNORING_WRAPPER.format(program=f"{sys.executable} {script} {rows}"))
    host = _host_run(tmp_path, ["bash", str(wrapper)], "SIGTERM", deliver_after=0, ready=lambda report: rows.exists())
    assert not isinstance(host, BaseException), host
    assert host[1] == {}, "an ignored signal was reported as heard"
    assert _run(COMMAND, [host], _watch(30, resumable=True)) == [None]
    assert rows.read_text().count("row 0") == 1


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads Linux's /proc")
def test_a_maxtext_like_program_behind_a_wrapper_that_ignores_the_signal_still_hears_it(fake, tmp_path):
    """The wrapper ignores SIGTERM, but the Python it starts installs its own handler (JAX's preemption notifier
    does): that process acts on it, so its clean exit is a stop, not a finish."""
    script, saved = tmp_path / "maxtext.py", tmp_path / "saved"
    script.write_text(MAXTEXT)
    wrapper = tmp_path / "train.sh"
    wrapper.write_text(IGNORING_WRAPPER.format(program=f"{sys.executable} {script} {saved}"))
    host = _host_run(tmp_path, ["bash", str(wrapper)], "SIGTERM", deliver_after=0,
                     ready=lambda report: os.path.exists(f"{saved}.ready"))
    assert saved.read_text().startswith("checkpoint"), host
    with pytest.raises(SuspendedError, match="the step stopped for it"):
        _run(COMMAND, [host], _watch(30, resumable=True))


def _offered_then_drained(kv) -> notices.Watch:
    """An elastic step with no preemption retry left: told an offer to grow, then a drain an hour ahead (held back)."""
    watch = notices.Watch("k", {"node0": "v6e-16-a/host0"}, resumable=False)
    watch.publish(PreemptionNotice(deadline=time.time() + notices.GROW_DEADLINE_S, reason="1 more slice free",
                                   grow=True))
    assert json.loads(kv["k"])["grow"], "the hosts were told the offer"
    watch.publish(PreemptionNotice(deadline=time.time() + 3600, reason="node0 is being drained", node="node0"))
    assert watch.held_back() and json.loads(kv["k"])["grow"], "the drain is held back: the hosts still see the offer"
    return watch


def test_a_step_that_stops_for_the_offer_it_was_told_while_a_drain_is_held_back_is_suspended_to_grow(fake, kv):
    """Before: the held-back drain hid the offer the hosts had acted on (`heard()` was None), so the step's
    StepSuspended for the offer read as a plain failure: the try failed."""
    watch = _offered_then_drained(kv)
    with pytest.raises(SuspendedError) as info:
        _run(FUNCTION, [StepSuspended("saved, to grow")], watch)
    assert info.value.node_id == "node0", "the drained node is avoided on resumption"
    assert gang.stopped_to_grow(watch), "it resumes as a growth (no preemption retry), not a failed try"


class _ReturnsAsTheWaitEnds(Ref):
    """A host whose value arrives just after the launcher's wait timed out (its body ended right at the stop)."""

    def __init__(self, value, fake: FakeRay) -> None:
        super().__init__(value)
        self._value, self._fake = value, fake

    @property
    def outcome(self):
        return self._value if len(self._fake.waits) > 1 else HANG

    @outcome.setter
    def outcome(self, value):
        pass


@pytest.mark.parametrize("due", ["notice-stop", "step_timeout"])
def test_a_function_step_that_returns_right_as_its_stop_comes_keeps_its_value(fake, due):
    """Before: the wait timed out, the value arrived, and the stop (or step_timeout) due then discarded it: a step
    that had finished was suspended and run again (or failed its try)."""
    spec = FUNCTION
    if due == "notice-stop":
        watch = _watch(-10, resumable=True)
        watch.noticed_at -= notices.MIN_GRACE_S  # the stop is due at once
    else:
        spec, watch = FUNCTION.model_copy(update={"step_timeout": 0.0}), None
    ref = _ReturnsAsTheWaitEnds({"exported": 1200}, fake)
    actor = types.SimpleNamespace(run=types.SimpleNamespace(remote=lambda *a: ref))
    assert gang.run_gang([actor], _plans(1), spec, host_process.Attempt(), None, watch) == [{"exported": 1200}]
