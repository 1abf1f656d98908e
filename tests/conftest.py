"""Shared fixtures: one real local Ray cluster per test session (two v6e-16, one v6e-4, 3 GPUs).

Set RAYSLICE_TEST_CLUSTER=<name> to reuse a cluster started with `rayslice local up --name <name>`
(handy while developing); otherwise the session starts its own on free ports and stops it,
by PID, at the end.
"""

from __future__ import annotations

import os
import time

import pytest

from rayslice import local_cluster

TEST_SPEC = local_cluster.ClusterSpec(tpus=("v6e-16", "v6e-16", "v6e-4"), gpus=3)
TOTAL_TPU_CHIPS = 36


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    reuse = os.environ.get("RAYSLICE_TEST_CLUSTER")
    if reuse:
        yield local_cluster.ClusterRecord.load(reuse)
        return
    home = tmp_path_factory.mktemp("rayslice-home")
    old = os.environ.get("RAYSLICE_HOME")
    os.environ["RAYSLICE_HOME"] = str(home)
    name = f"pytest-{os.getpid()}"
    record = local_cluster.up(TEST_SPEC, name=name)
    try:
        yield record
    finally:
        local_cluster.down(name)
        if old is None:
            os.environ.pop("RAYSLICE_HOME", None)
        else:
            os.environ["RAYSLICE_HOME"] = old


@pytest.fixture(scope="session")
def ray_driver(cluster):
    """This process as a Ray driver on the test cluster (cluster-side tests only)."""
    import ray

    for key, value in cluster.ray_env().items():
        os.environ.setdefault(key, value)
    ray.init(address=cluster.gcs_address, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


def wait_until(condition, timeout: float = 10.0, interval: float = 0.05):
    """Poll `condition` until it is truthy; returns its last value (tests assert on it)."""
    deadline = time.monotonic() + timeout
    value = condition()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = condition()
    return value
