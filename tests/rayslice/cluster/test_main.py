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
