"""Losing a host's whole node mid-step (preemption) on a cluster of its own: two single-host v6e-4 slices."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

from rayslice import local_cluster
from rayslice.accelerators import TpuSliceRequest
from rayslice.exceptions import PreemptedError
from rayslice.step import Owner, StepSpec
from tests.conftest import private_cluster, wait_until


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = local_cluster.ClusterSpec(tpus=("v6e-4", "v6e-4"))
    home = tmp_path_factory.mktemp("preemption-home")
    with private_cluster(home, "preemption", lambda: local_cluster.up(spec, name="preemption")) as record:
        yield record


def wait_then_report(folder: str):
    """Marks which slice it runs on, then waits: the test removes that slice's node."""
    import os
    import time

    Path(folder, os.environ["TPU_NAME"]).touch()
    for _ in range(600):
        if Path(folder, "done").exists():
            return os.environ["TPU_NAME"]
        time.sleep(0.1)
    return "timed out"


def remove_node_under_the_step(record, folder: str) -> str:
    """The first slice the step lands on loses its node: every process of that `ray start` session dies."""
    deadline = time.monotonic() + 120
    while not os.listdir(folder) and time.monotonic() < deadline:
        time.sleep(0.1)
    victim = os.listdir(folder)[0]
    node = next(n for n in record.nodes if n.slice_name == victim)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == node.pid:
                    os.kill(int(entry.name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return victim


def run_as_job(record, spec):
    """Through the Jobs API: this test process may already be a Ray driver of the main test cluster."""
    import asyncio

    from rayslice.submission import run_step_job

    return asyncio.run(run_step_job(record.dashboard_url, spec, emit=print))


def free_chips_match_alive_hosts(record) -> bool:
    nodes = local_cluster.alive_nodes(record.dashboard_url)
    total = sum(n["resources_total"].get("TPU", 0) for n in nodes)
    from rayslice.capacity import snapshot

    return total > 0 and all(s.state == "free" for s in snapshot(record.dashboard_url).slices)


def test_a_lost_node_is_a_preemption_and_the_gang_retries_on_a_fresh_slice(small_cluster):
    with tempfile.TemporaryDirectory() as folder:
        spec = StepSpec.for_function(
            wait_then_report,
            request=TpuSliceRequest(tpu="v6e-4"),
            kwargs={"folder": folder},
            preemption_retries=1,
            owner=Owner(run_id=f"preempt-{time.time_ns()}"),
        )
        victim: dict[str, str] = {}
        killer = threading.Thread(
            target=lambda: victim.setdefault("name", remove_node_under_the_step(small_cluster, folder))
        )
        releaser = threading.Thread(
            target=lambda: (wait_until(lambda: len(os.listdir(folder)) >= 2, 180), Path(folder, "done").touch())
        )
        killer.start()
        releaser.start()
        result = run_as_job(small_cluster, spec)
        killer.join()
        releaser.join()
    survivor = next(n for n in ("v6e-4-a", "v6e-4-b") if n != victim["name"])
    assert result == [survivor]
    assert wait_until(lambda: free_chips_match_alive_hosts(small_cluster), timeout=10)


def test_without_retries_a_lost_node_fails_the_step_naming_the_host(small_cluster):
    with tempfile.TemporaryDirectory() as folder:
        spec = StepSpec.for_function(
            wait_then_report,
            request=TpuSliceRequest(tpu="v6e-4"),
            kwargs={"folder": folder},
            owner=Owner(run_id=f"preempt-{time.time_ns()}"),
        )
        killer = threading.Thread(target=remove_node_under_the_step, args=(small_cluster, folder))
        killer.start()
        started = time.monotonic()
        with pytest.raises(PreemptedError, match=r"v6e-4-[ab]/host0 .*node was preempted or removed"):
            run_as_job(small_cluster, spec)
        killer.join()
    assert time.monotonic() - started < 60
