"""Two xdist workers share the suite: one runs everything on the session's cluster, the other the rest.

`./scripts/test -n 2 --dist loadgroup` runs the whole suite on two workers (not the default:
BENCHMARKS.md, the suite's time). The tests on the session's cluster and
Airflow share its slices, so they cannot overlap: they are one group (`tests/conftest.py`, `groups`),
which the session worker (`SESSION_WORKER`, the only one that starts the session's cluster) runs whole,
in the collection's order, as one process would. Beside it, the other worker runs what needs no session
cluster: the cluster-free tests one by one, and each module with a cluster or an Airflow of its own,
whole (a module's tests share its module fixtures). Without a session group (`-m "not cluster"`) both
workers share everything.

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
#: The worker that runs the session's group, and so the only one that starts the session's cluster.
SESSION_WORKER = "gw0"


def active(config: pytest.Config) -> bool:
    """Whether this run distributes by group (`--dist loadgroup`), in the controller or a worker."""
    return config.getoption("dist", default=None) == "loadgroup" or bool(getattr(config.option, "loadgroup", False))


def runs_the_session_group(config: pytest.Config) -> bool:
    """Whether this process may run tests on the session's cluster: not the other worker of a grouped run."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return not (worker and active(config)) or worker == SESSION_WORKER


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("dist", default=None) == "loadgroup" and not os.environ.get("PYTEST_XDIST_WORKER"):
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
    """xdist's scope scheduling with our groups as the scopes, taken in the collection's order; the
    session's group goes to the session worker only."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # the collection's order: cluster-free first, as the clusters start
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            self._groups = _load()
        return self._groups.get(nodeid, nodeid)

    def _assign_work_unit(self, node) -> None:
        """The session's group to the session worker first; any other worker takes the next other unit."""
        from tests.conftest import SESSION_GROUP

        if SESSION_GROUP in self.workqueue and self._may_run_the_session_group(node):
            self.workqueue.move_to_end(SESSION_GROUP, last=False)
        elif self.workqueue and next(iter(self.workqueue)) == SESSION_GROUP:
            if len(self.workqueue) == 1:
                return  # only the session's group is left, and it is not this worker's
            self.workqueue.move_to_end(SESSION_GROUP)
        super()._assign_work_unit(node)

    def _may_run_the_session_group(self, node) -> bool:
        """The session worker; any worker once it is gone (a crashed worker's replacement has a new id)."""
        return node.gateway.id == SESSION_WORKER or all(n.gateway.id != SESSION_WORKER for n in self.nodes)

    def _reschedule(self, node) -> None:
        from tests.conftest import SESSION_GROUP

        only_the_session_group_left = list(self.workqueue) == [SESSION_GROUP]
        if not node.shutting_down and only_the_session_group_left and not self._may_run_the_session_group(node):
            if self._pending_of(self.assigned_work[node]) == 0:
                node.shutdown()  # nothing left that this worker may run
            return
        super()._reschedule(node)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> GroupScheduling | None:
    return GroupScheduling(config, log) if config.getoption("dist", default=None) == "loadgroup" else None
