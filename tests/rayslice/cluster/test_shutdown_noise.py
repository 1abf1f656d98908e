"""A suspension's expected shutdown noise reaches the task log explained, never as a fatal error (issue 49).

Driven through the driver's own log dispatcher (Ray's, no cluster): a stand-in for Ray's printer records
what the job log would get.
"""

from __future__ import annotations

import pytest
from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

from rayslice.cluster import gang, shutdown_noise

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
    drain = gang.LogDrain()
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
    assert ("v6e-16-a/host1", shutdown_noise.EXPLAINED) in printed
    assert ("v6e-16-a/host1", "saving step 120") in printed
    assert ("v6e-16-a/host2", "ZeroDivisionError: division by zero") in printed
