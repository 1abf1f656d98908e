"""Two xdist workers share the suite, each with a session cluster of its own (`scripts/test`'s default).

The tests on a session cluster share its slices, so they cannot overlap: they are a pinned group
(`tests/conftest.py`, `groups` and `PINNED_GROUPS`) that one worker runs whole, in the collection's order, as
one process would: gw0 the tests on the session Airflow and most of the cluster tests, gw1 the launcher's own
(`tests/rayslice/cluster/`) on a second session cluster. Each worker starts its session cluster in the
background and runs cluster-free tests, shared between the two, until none is left; then its own group; then
whatever no worker is pinned to (each module with a cluster or an Airflow of its own, whole: a module's tests
share its module fixtures). A worker that is gone (crashed) has its group run by any worker.

Why not xdist's own `loadgroup` and `xdist_group` marks: xdist 3.8 tells the scheduler a test's group by
appending it to `item._nodeid`, which pytest 9 no longer reads (a node's id is `item._id`), so every test
went out on its own, and module fixtures were made once per worker. Here each worker writes the groups it
computed to a file named by `RAYSLICE_TEST_GROUPS` (set by the controller before the workers start; every
worker collects the same tests), and the scheduler, which sees only test ids, reads it once collection ended.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

GROUPS_ENV = "RAYSLICE_TEST_GROUPS"
#: What `pinned_group_here` says of a worker of a grouped run that has no pinned group.
NO_GROUP = ""


def pinned_groups() -> dict[str, str]:
    """Group -> the worker that runs it (tests/conftest.py)."""
    from tests.conftest import PINNED_GROUPS

    return PINNED_GROUPS


def active(config: pytest.Config) -> bool:
    """Whether this run distributes by group (`--dist loadgroup`), in the controller or a worker."""
    return config.getoption("dist", default=None) == "loadgroup" or bool(getattr(config.option, "loadgroup", False))


def pinned_group_here(config: pytest.Config) -> str | None:
    """The pinned group this process runs in a grouped run (`NO_GROUP` for a worker without one); None in one
    process or a run not grouped, which may run any test."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not (worker and active(config)):
        return None
    return next((group for group, pinned in pinned_groups().items() if pinned == worker), NO_GROUP)


#: The folders this process made to share with its workers (folder -> the variable naming it): the only ones it
#: removes, not one that a variable left set in its environment names.
_made: dict[str, str] = {}


def is_controller(config: pytest.Config) -> bool:
    """Not an xdist worker (xdist gives its workers' configs `workerinput`); PYTEST_XDIST_WORKER may be left set in
    the environment of a process that is none."""
    return not hasattr(config, "workerinput")


def share_folder(env: str, prefix: str) -> str:
    """A new temporary folder named by `env` to the workers (they start later, with this environment), removed by
    this process when it ends (`pytest_unconfigure`: also after a run with no session, `--markers`, `--help`)."""
    folder = tempfile.mkdtemp(prefix=prefix)
    _made[folder] = env
    os.environ[env] = folder
    return folder


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("dist", default=None) == "loadgroup" and is_controller(config):
        share_folder(GROUPS_ENV, "rayslice-test-groups-")


def pytest_unconfigure(config: pytest.Config) -> None:
    while _made:
        folder, env = _made.popitem()
        shutil.rmtree(folder, ignore_errors=True)
        if os.environ.get(env) == folder:
            del os.environ[env]


@pytest.hookimpl(trylast=True)  # after `-k`, `-m` and `--deselect` took what was not asked for
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if active(config):
        from tests.conftest import groups

        record(groups(items))


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

    def schedule(self) -> None:
        """xdist's, but where there are fewer units than workers, the workers it sends home are not the ones
        pinned to a group that is there (it would send home the last to register, whichever that is)."""
        if self.collection is None and self.collection_is_completed and self.registered_collections:
            units = {self._split_scope(test) for test in next(iter(self.registered_collections.values()))}
            wanted = {worker for group, worker in pinned_groups().items() if group in units}
            self.assigned_work = dict(sorted(self.assigned_work.items(),
                                             key=lambda item: item[0].gateway.id not in wanted))
        super().schedule()

    def _assign_work_unit(self, node) -> None:
        """The next cluster-free test (meanwhile the worker's session cluster starts); once none is left, the
        worker's own pinned group; then the next unit no worker is pinned to (modules with clusters of their own);
        else nothing: only other workers' groups are left.

        Every worker runs cluster-free tests before any test on a cluster, as one process does: a cluster test
        may leave its process changed (a Ray driver, Ray's threads, a module's state), and the cluster-free
        tests were written, and always ran, before any of that.
        """
        pinned = pinned_groups()
        named = set(self._groups.values()) if self._groups else set()
        free = next((unit for unit in self.workqueue if unit not in named), None)
        mine = next((g for g in pinned if g in self.workqueue and self._may_run(node, g)), None)
        other = next((unit for unit in self.workqueue if unit not in pinned), None)
        unit = next((choice for choice in (free, mine, other) if choice is not None), None)
        if unit is None:
            return
        self.workqueue.move_to_end(unit, last=False)
        super()._assign_work_unit(node)

    def _may_run(self, node, group: str) -> bool:
        """The group's worker; any worker once it is gone (a crashed worker's replacement has a new id)."""
        worker = pinned_groups()[group]
        return node.gateway.id == worker or all(n.gateway.id != worker for n in self.nodes)

    def _may_run_any(self, node) -> bool:
        pinned = pinned_groups()
        return any(unit not in pinned or self._may_run(node, unit) for unit in self.workqueue)

    def remove_node(self, node) -> str | None:
        """xdist's, but the test the worker died on is not queued again: xdist reports it as failed
        (`handle_crashitem`), and a test that kills its worker would kill each replacement in turn."""
        workload = self.assigned_work.get(node, {})
        crashed = next(((unit, test) for unit, tests in workload.items() for test, done in tests.items() if not done),
                       None)
        if crashed is None:
            return super().remove_node(node)
        workload[crashed[0]][crashed[1]] = True
        for unit in [unit for unit, tests in workload.items() if all(tests.values())]:
            del workload[unit]  # nothing of it left to run
        super().remove_node(node)  # the rest back in the queue, and the others rescheduled
        return crashed[1]

    def _reschedule(self, node) -> None:
        """xdist's, but a worker is never left holding a single test: an xdist worker runs a test only once it
        knows the next one or that none comes (`shutdown`). So it gets units until it holds two tests, and is
        told to stop as soon as nothing is left that it may run, even with tests in hand."""
        while not node.shutting_down:
            if not self.workqueue or not self._may_run_any(node):
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) >= 2:
                return
            self._assign_work_unit(node)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: unknown under `-p no:xdist`
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> GroupScheduling | None:
    return GroupScheduling(config, log) if config.getoption("dist", default=None) == "loadgroup" else None
