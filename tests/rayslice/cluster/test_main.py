"""The job driver's last line: the step's value, the step's error, or the launcher's own failure, never mixed up."""

from __future__ import annotations

import json
import signal

import pytest

from rayslice.cluster import __main__ as driver
from rayslice.core.accelerators import AcceleratorRequest
from rayslice.core.step import ERROR_MARKER, RESULT_MARKER, StepSpec


def returns_a_set():
    return {1, 2}


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(StepSpec.for_function(returns_a_set, request=AcceleratorRequest(resource="GPU", count=0.25))
                    .model_dump_json())
    return str(path)


@pytest.fixture
def no_cluster(monkeypatch):
    """`main` without a cluster: ray.init is a no-op and the SIGTERM handler is put back afterwards."""
    import ray

    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def last_marked_line(out: str) -> tuple[str, object]:
    line = [line for line in out.splitlines() if line.startswith((RESULT_MARKER, ERROR_MARKER))][-1]
    marker = RESULT_MARKER if line.startswith(RESULT_MARKER) else ERROR_MARKER
    return marker, json.loads(line[len(marker):])


def test_a_value_that_is_not_json_gets_the_not_json_message(spec_file, no_cluster, monkeypatch, capsys):
    monkeypatch.setattr("rayslice.cluster.run_step", lambda spec, **_: {1, 2})
    assert driver.main(["launcher", spec_file]) == 1
    marker, error = last_marked_line(capsys.readouterr().out)
    assert marker == ERROR_MARKER and error["type"] == "StepFailedError"
    assert "the step returned a value that is not JSON" in error["message"]


def test_a_launcher_bug_is_reported_as_one_not_as_the_steps_value(spec_file, no_cluster, monkeypatch, capsys):
    def launcher_bug(spec, **_):
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")

    monkeypatch.setattr("rayslice.cluster.run_step", launcher_bug)
    assert driver.main(["launcher", spec_file]) == 1
    out = capsys.readouterr()
    marker, error = last_marked_line(out.out)
    assert marker == ERROR_MARKER and error["type"] == "LauncherError"
    assert "not JSON" not in error["message"]
    assert "the rayslice launcher itself failed (TypeError: unsupported operand" in error["message"]
    assert "Traceback" in out.err  # the whole traceback is in the job log


def test_a_json_value_is_the_result_line(spec_file, no_cluster, monkeypatch, capsys):
    monkeypatch.setattr("rayslice.cluster.run_step", lambda spec, **_: [[4, 0]])
    assert driver.main(["launcher", spec_file]) == 0
    assert last_marked_line(capsys.readouterr().out) == (RESULT_MARKER, [[4, 0]])


def test_a_result_too_large_for_the_result_line_says_the_limit_and_what_to_do(spec_file, no_cluster, monkeypatch,
                                                                               capsys):
    monkeypatch.setattr("rayslice.cluster.run_step", lambda spec, **_: ["x" * 1024] * 2048)  # 2 MiB of JSON
    assert driver.main(["launcher", spec_file]) == 1
    marker, error = last_marked_line(capsys.readouterr().out)
    assert marker == ERROR_MARKER and error["type"] == "StepFailedError"
    assert "over the 1 MiB a step may return" in error["message"]
    assert "checkpoint_dir" in error["message"] and "return their path" in error["message"]


def last_words_then(crash: str):
    """A host prints a burst of lines, then its last words, then crashes the way `crash` says."""
    import os
    import signal
    import sys

    for i in range(1000):
        print(f"progress line {i}")
    print("last words before the crash", flush=True)
    sys.stderr.flush()
    if crash == "raise":
        raise RuntimeError("crashed on purpose")
    if crash == "os._exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("crash", ["raise", "os._exit", "sigkill"])
def test_a_hosts_last_line_before_a_crash_is_in_the_job_log(cluster, crash):
    import asyncio

    from rayslice.client.submission import run_step_job
    from rayslice.core.exceptions import StepFailedError

    lines: list[str] = []
    spec = StepSpec.for_function(last_words_then, request=AcceleratorRequest(resource="GPU", count=0.25),
                                 kwargs={"crash": crash})
    with pytest.raises(StepFailedError):
        asyncio.run(run_step_job(cluster.dashboard_url, spec, token=cluster.token, emit=lines.append))
    assert any(line.endswith("progress line 999") for line in lines), lines[-5:]
    assert any(line.endswith("last words before the crash") for line in lines), lines[-5:]


def sleeps():
    import time

    time.sleep(600)


@pytest.mark.parametrize("request_", [AcceleratorRequest(resource="GPU", count=0.25),
                                      AcceleratorRequest(resource="TPU", count=4)], ids=["gpu-fraction", "tpu-chips"])
def test_ray_job_stop_unwinds_the_driver_and_frees_the_capacity(cluster, ray_driver, request_):
    """SIGTERM lands inside `ray.wait`: the driver still unwinds, releases, says so, and exits before Ray's SIGKILL.

    TPU chips take the node-selector path (chips of one slice type), not a placement group: freed all the same.
    """
    import asyncio

    from rayslice.client.jobs_client import AsyncRayJobsClient, RayJobsClient
    from rayslice.client.submission import submit_step
    from tests.conftest import TOTAL_TPU_CHIPS, wait_until

    spec = StepSpec.for_function(sleeps, request=request_)

    async def submit() -> str:
        async with AsyncRayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
            return await submit_step(client, spec, emit=lambda _: None)

    sid = asyncio.run(submit())
    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
        assert wait_until(lambda: f"[rayslice] running on {request_}" in client.logs(sid), timeout=180, interval=0.5), (
            client.logs(sid)[-3000:])
        if request_.resource == "TPU":
            assert ray_driver.available_resources().get("TPU", 0) <= TOTAL_TPU_CHIPS - 4  # held while it runs
        client.stop(sid)
        assert wait_until(lambda: client.get(sid).is_terminal, timeout=60, interval=0.2)
        log = client.logs(sid)
    assert "[rayslice] stopped on request; capacity released" in log, log[-2000:]
    assert f"[rayslice] released {request_}" in log
    if request_.resource == "TPU":
        assert wait_until(lambda: ray_driver.available_resources().get("TPU") == TOTAL_TPU_CHIPS, timeout=10)


def test_a_job_that_stood_by_is_no_step_in_the_clusters_metrics(spec_file, no_cluster, monkeypatch, capsys):
    """A cluster set's member whose job stood by (another cluster ran the step) held nothing and failed nothing:
    it is not counted as a step, nor as a failure, in `rayslice_steps` / `rayslice_step_failures`. Its error line
    stays: the submitter reads it as "stood by"."""
    from rayslice.cluster.metrics import sender
    from rayslice.core.exceptions import RanElsewhereError

    counted: list[tuple] = []
    monkeypatch.setattr(sender, "step", lambda spec, outcome, error=None: counted.append((outcome, error)))

    def stood_by(spec, **_):
        raise RanElsewhereError("cluster b of set 'tpus' ran this step (succeeded); cluster a stood by")

    monkeypatch.setattr("rayslice.cluster.run_step", stood_by)
    assert driver.main(["launcher", spec_file]) == 1
    marker, error = last_marked_line(capsys.readouterr().out)
    assert marker == ERROR_MARKER and error["type"] == "RanElsewhereError"
    assert counted == []
    monkeypatch.setattr("rayslice.cluster.run_step", lambda spec, **_: [[4, 0]])  # a step that ran here is counted
    assert driver.main(["launcher", spec_file]) == 0
    assert counted == [("succeeded", None)]


def test_an_attempt_that_stood_by_is_no_attempt_in_the_clusters_metrics(monkeypatch):
    """`run_step` on a member whose job stands by (it raises `RanElsewhereError` before anything is held): no attempt
    is sent to the phase and queue-wait histograms (each observation there is an attempt), and no goodput record."""
    import rayslice.cluster as launcher
    from rayslice.core.exceptions import RanElsewhereError

    sent: list[str] = []
    monkeypatch.setattr(launcher.metrics.sender, "attempt", lambda spec, times, wait: sent.append("attempt"))
    monkeypatch.setattr(launcher.metrics.sender, "goodput", lambda spec, account: sent.append("goodput"))
    monkeypatch.setattr(launcher, "_require_connected_driver", lambda: None)
    monkeypatch.setattr(launcher, "_reap_orphans", lambda spec: None)

    def stands_by(*args, **kwargs):
        raise RanElsewhereError("cluster b of set 'tpus' ran this step (succeeded); cluster a stood by")

    monkeypatch.setattr(launcher, "_run_on_fraction", stands_by)
    spec = StepSpec.for_function(returns_a_set, request=AcceleratorRequest(resource="GPU", count=0.25))
    with pytest.raises(RanElsewhereError):
        launcher.run_step(spec, driver_phases={"driver_started": 1.0, "accepted": 0.5})
    assert sent == []
    monkeypatch.setattr(launcher, "_run_on_fraction", lambda *args, **kwargs: 1)  # one that ran here is sent
    launcher.run_step(spec, driver_phases={"driver_started": 1.0, "accepted": 0.5})
    assert sent == ["attempt"]
