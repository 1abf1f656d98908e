"""Two xdist workers share the suite; the tests that must run in one process stay together.

`scripts/test` runs the whole suite as `-n 2 --dist loadgroup`: each worker starts its own session cluster,
so most cluster tests may run in either, and one worker's tests run while the other's wait on Ray, JAX or
Airflow. But a module's tests share its module fixtures (a private cluster, a private Airflow), and every
test of the session's Airflow must run where it was started (it starts once, and stops after its last user):
`tests/conftest.py` says which tests go together (`groups`), and this scheduler sends each group to one
worker whole, in the collection's order (cluster-free tests first, while the clusters start).

Why not xdist's own `loadgroup` and `xdist_group` marks: xdist 3.8 tells the scheduler a test's group by
appending it to `item._nodeid`, which pytest 9 no longer reads (a node's id is `item._id`), so every test
went out on its own, and module fixtures were made once per worker. Here each worker writes the groups it
computed to a file named by `RAYSLICE_TEST_GROUPS` (set by the controller before the workers start; every
worker collects the same tests), and the scheduler, which sees only test ids, reads it once collection ended.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

GROUPS_ENV = "RAYSLICE_TEST_GROUPS"


def active(config: pytest.Config) -> bool:
    """Whether this run distributes by group (`--dist loadgroup`), in the controller or a worker."""
    return config.getvalue("dist") == "loadgroup" or bool(getattr(config.option, "loadgroup", False))


def pytest_configure(config: pytest.Config) -> None:
    if config.getvalue("dist") == "loadgroup" and not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = Path(tempfile.mkdtemp(prefix="rayslice-test-groups-"))
        os.environ[GROUPS_ENV] = str(folder)  # the workers start after this, with this environment


def record(groups: dict[str, str]) -> None:
    """A worker's grouping (test id -> group); tests not named are each a unit of their own."""
    folder = os.environ.get(GROUPS_ENV)
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        path = Path(folder) / f"{worker}.json"
        path.with_suffix(".tmp").write_text(json.dumps(groups))
        path.with_suffix(".tmp").replace(path)


def _load() -> dict[str, str]:
    folder = os.environ.get(GROUPS_ENV)
    for path in sorted(Path(folder).glob("*.json")) if folder else ():
        return json.loads(path.read_text())
    return {}


class GroupScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with our groups as the scopes, taken in the collection's order."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # the collection's order: cluster-free first, as the clusters start
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            self._groups = _load()
        return self._groups.get(nodeid, nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> GroupScheduling | None:
    return GroupScheduling(config, log) if config.getvalue("dist") == "loadgroup" else None
