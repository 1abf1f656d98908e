"""Shared fixtures: one real local Ray cluster per test session (two v6e-16, one v6e-4, 3 GPUs).

Set RAYSLICE_TEST_CLUSTER=<name> to reuse a cluster started with `rayslice local up --name <name>`
(handy while developing); otherwise the session starts its own on free ports and stops it,
by PID, at the end.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rayslice.local import local_cluster

TEST_SPEC = local_cluster.ClusterSpec(tpus=("v6e-16", "v6e-16", "v6e-4"), gpus=3)
TOTAL_TPU_CHIPS = 36

#: Fixtures that start or use a local Ray cluster, and those that start a whole Airflow or a browser.
#: A test that needs any of them (directly or through another fixture) gets the matching mark, so
#: `-m "not cluster"` is the fast loop: everything that runs without a cluster.
CLUSTER_FIXTURES = {"cluster", "small_cluster", "autoscaling_cluster", "token_cluster", "ray_driver", "_head_factory"}
AIRFLOW_FIXTURES = {"airflow", "airflow_stack"}
BROWSER_FIXTURES = {"browser"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        needs = set(getattr(item, "fixturenames", ()))
        if needs & CLUSTER_FIXTURES:
            item.add_marker(pytest.mark.cluster)
        if needs & AIRFLOW_FIXTURES:
            item.add_marker(pytest.mark.airflow)
        if needs & BROWSER_FIXTURES or item.get_closest_marker("browser"):
            item.add_marker(pytest.mark.browser)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    reuse = os.environ.get("RAYSLICE_TEST_CLUSTER")
    if reuse:
        yield local_cluster.ClusterRecord.load(reuse)
        return
    home = tmp_path_factory.mktemp("rayslice-home")
    name = f"pytest-{os.getpid()}"
    with rayslice_home(home):
        record = local_cluster.up(TEST_SPEC, name=name)
    os.environ["RAYSLICE_HOME"] = str(home)  # for the whole session: the CLI tests find it there
    try:
        yield record
    finally:
        with rayslice_home(home):  # whatever a module fixture did to the variable, stop *this* cluster
            local_cluster.down(name)
        os.environ.pop("RAYSLICE_HOME", None)


@contextlib.contextmanager
def rayslice_home(home: str | Path) -> Iterator[None]:
    """`RAYSLICE_HOME` set to `home` inside the block, and restored after it, even on errors."""
    old = os.environ.get("RAYSLICE_HOME")
    os.environ["RAYSLICE_HOME"] = str(home)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("RAYSLICE_HOME", None)
        else:
            os.environ["RAYSLICE_HOME"] = old


@contextlib.contextmanager
def private_cluster(home: Path, name: str, start: Callable[[], local_cluster.ClusterRecord]) -> Iterator:
    """A test module's own cluster under its own `RAYSLICE_HOME`, stopped by PID at the end.

    The start is tried twice: a second cluster on a loaded 2-core machine can miss a node's
    start-up deadline once (`up` stops what it started before raising).
    """
    with rayslice_home(home):
        try:
            record = start()
        except Exception:
            with contextlib.suppress(Exception):
                local_cluster.down(name)
            record = start()
        try:
            yield record
        finally:
            local_cluster.down(name)


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
