"""A suspension's expected shutdown noise reaches the task log explained, never as a fatal error (issue 49).

Driven through the driver's own log dispatcher (Ray's, no cluster): a stand-in for Ray's printer records
what the job log would get.
"""

from __future__ import annotations

import pytest
from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

from rayslice.cluster import log_drain, shutdown_noise

FATAL = ("F1206 04:01:02.345678 1234 client.cc:101] Terminating process because the JAX distributed service "
         "detected fatal errors. This most likely indicates that another task died; see the other task logs for "
         "more details. absl::Status: UNAVAILABLE: Failed to send RPC to coordination service")


@pytest.fixture
def printed():
    """What Ray's printer (the job log) gets: a recorder beside it, both installed before the drain, as in a driver."""
    out: list[tuple[str, str]] = []
    installed = any(name == "ray_print_logs" for name, _ in dispatcher.handlers)
    if not installed:  # a driver that prints its hosts' output (the drain is active only there)
        dispatcher.add_handler("ray_print_logs", lambda data: None)
    dispatcher.add_handler("test-printed", lambda data: out.extend(
        (data.get("actor_name", ""), line) for line in data["lines"]))
    yield out
    dispatcher.remove_handler("test-printed")
    if not installed:
        dispatcher.remove_handler("ray_print_logs")


def _host(label: str, *lines: str) -> None:
    dispatcher.emit({"actor_name": label, "pid": 4242, "is_err": True, "lines": list(lines)})


def test_after_a_notice_a_hosts_jax_termination_is_explained_and_real_errors_stay(printed):
    noticed = False
    drain = log_drain.LogDrain()
    drain.explain_shutdown({"v6e-16-a/host1", "v6e-16-a/host2"}, lambda: noticed)
    try:
        _host("v6e-16-a/host1", FATAL)  # before any notice: a real failure, as it came
        noticed = True
        _host("v6e-16-a/host1", "saving step 120", FATAL)
        _host("v6e-16-a/host2", "ZeroDivisionError: division by zero")  # a real error after the notice stays
        _host("v6e-16-b/host0", FATAL)  # another attempt's host: not this suspension's
    finally:
        drain.close()
    _host("v6e-16-a/host2", FATAL)  # after the attempt: as it came
    fatal = [(label, line) for label, line in printed if shutdown_noise.FATAL_SIGN in line]
    assert fatal == [("v6e-16-a/host1", FATAL), ("v6e-16-b/host0", FATAL), ("v6e-16-a/host2", FATAL)]
    assert ("v6e-16-a/host1", shutdown_noise.explained(FATAL)) in printed
    assert ("v6e-16-a/host1", "saving step 120") in printed
    assert ("v6e-16-a/host2", "ZeroDivisionError: division by zero") in printed


def test_a_filter_that_fails_never_stops_rays_printer(printed):
    """The filter runs inside Ray's dispatcher, before its printer, on Ray's one log thread: a failure of its own
    (here the notice check) must pass the line as it came, not end that thread (every later line of the driver lost)."""
    def noticed() -> bool:
        raise RuntimeError("notice state unreadable")

    drain = log_drain.LogDrain()
    drain.explain_shutdown({"v6e-16-a/host1"}, noticed)
    try:
        _host("v6e-16-a/host1", FATAL)  # raised out of emit before: Ray's print thread would have ended
        _host("v6e-16-a/host1", "after it")
    finally:
        drain.close()
    assert ("v6e-16-a/host1", FATAL) in printed
    assert ("v6e-16-a/host1", "after it") in printed


class _OtherRay:
    """A dispatcher of a Ray whose internals differ (no `_lock`, handlers kept elsewhere): only its public methods."""

    def __init__(self) -> None:
        self._pairs: list = [("ray_print_logs", lambda data: None)]

    @property
    def handlers(self) -> list:
        return list(self._pairs)

    def add_handler(self, name, handler) -> None:
        self._pairs.append((name, handler))

    def remove_handler(self, name) -> None:
        self._pairs = [p for p in self._pairs if p[0] != name]


def test_on_a_ray_whose_dispatcher_differs_the_filter_stands_aside_and_says_so(capsys):
    """explain_shutdown runs once capacity is reserved: raising there failed the step over a cosmetic filter."""
    other = _OtherRay()
    explainer = shutdown_noise.Explainer(other, {"v6e-16-a/host1"}, lambda: True)
    explainer.close()
    assert [name for name, _ in other.handlers] == ["ray_print_logs"]
    assert "shown as they come" in capsys.readouterr().out


def test_the_explained_line_keeps_what_jax_said_went_wrong(printed):
    """The filter decides when a line reaches the driver: a real failure's line (a host out of memory) that arrives
    after the notice is explained too. Its cause must stay in the log, only the fatal wording goes."""
    drain = log_drain.LogDrain()
    drain.explain_shutdown({"v6e-16-a/host1"}, lambda: True)
    real = FATAL.replace("UNAVAILABLE: Failed to send RPC to coordination service",
                         "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17.2GiB")
    try:
        _host("v6e-16-a/host1", real)
    finally:
        drain.close()
    [line] = [line for label, line in printed if label == "v6e-16-a/host1"]
    assert line.startswith(shutdown_noise.EXPLAINED) and shutdown_noise.FATAL_SIGN not in line
    assert "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17.2GiB" in line


def test_on_a_ray_that_keeps_its_handlers_by_name_the_drain_stands_aside(monkeypatch):
    """The drain is made once capacity is reserved, before the attempt's try: raising there left the slices held."""
    from ray._private import ray_logging

    class ByName:
        def __init__(self) -> None:
            self.handlers = {"ray_print_logs": lambda data: None}

        def add_handler(self, name, handler) -> None:
            self.handlers[name] = handler

        def remove_handler(self, name) -> None:
            self.handlers.pop(name, None)

    other = ByName()
    monkeypatch.setattr(ray_logging, "global_worker_stdstream_dispatcher", other)
    drain = log_drain.LogDrain()
    drain.explain_shutdown({"v6e-16-a/host1"}, lambda: True)
    drain.wait(["v6e-16-a/host1"])
    drain.close()
    assert list(other.handlers) == ["ray_print_logs"]
