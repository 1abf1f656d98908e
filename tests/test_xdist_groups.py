"""The two-worker scheduler (tests/xdist_groups.py): the session's group runs whole on the session worker only.

Driven the way pytest-xdist drives it (nodes added, collections registered, `schedule`, each test
marked complete), with stand-in worker nodes that record what they were sent.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests import xdist_groups
from tests.conftest import SESSION_GROUP

COLLECTION = ["tests/a.py::free_1", "tests/a.py::free_2", "tests/b.py::on_session_1", "tests/b.py::on_session_2",
              "tests/c.py::on_second_1", "tests/d.py::own_cluster_1", "tests/d.py::own_cluster_2",
              "tests/e.py::on_session_3", "tests/a.py::free_3"]
GROUPS = {"tests/b.py::on_session_1": SESSION_GROUP, "tests/b.py::on_session_2": SESSION_GROUP,
          "tests/e.py::on_session_3": SESSION_GROUP, "tests/c.py::on_second_1": "tests/c.py",
          "tests/d.py::own_cluster_1": "tests/d.py", "tests/d.py::own_cluster_2": "tests/d.py"}


class Node:
    """A stand-in for xdist's WorkerController: what the scheduler sent it, in order."""

    def __init__(self, worker: str) -> None:
        self.gateway = SimpleNamespace(id=worker)
        self.sent: list[str] = []
        self.shutting_down = False

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent.extend(COLLECTION[i] for i in indexes)

    def shutdown(self) -> None:
        self.shutting_down = True


@pytest.fixture
def scheduler(tmp_path, monkeypatch):
    monkeypatch.setenv(xdist_groups.GROUPS_ENV, str(tmp_path))
    (tmp_path / "gw0.json").write_text(json.dumps(GROUPS))
    config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=True), getvalue=lambda name: None)
    monkeypatch.setattr(xdist_groups.LoadScopeScheduling, "__init__", _plain_init)
    return xdist_groups.GroupScheduling(config)


def _plain_init(self, config, log=None) -> None:  # xdist's, less reading `-n` from a real config
    from collections import OrderedDict

    self.numnodes, self.collection, self.config = 2, None, config
    self.workqueue, self.assigned_work, self.registered_collections = OrderedDict(), {}, {}
    self.log = lambda *args: None


def run(scheduler, *nodes: Node) -> None:
    """Register the nodes, schedule, then complete each node's tests in turn until nothing is left."""
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, COLLECTION)
    scheduler.schedule()
    done = {node: 0 for node in nodes}
    while any(done[node] < len(node.sent) for node in nodes):
        for node in nodes:  # one test each, alternately: two workers progressing at once
            if done[node] < len(node.sent):
                scheduler.mark_test_complete(node, COLLECTION.index(node.sent[done[node]]))
                done[node] += 1


def test_the_session_group_runs_whole_in_order_on_the_session_worker_only(scheduler):
    other, session = Node("gw1"), Node("gw0")  # the other worker registers first
    run(scheduler, other, session)
    on_session = [n for n in COLLECTION if GROUPS.get(n) == SESSION_GROUP]
    assert [n for n in session.sent if n in on_session] == on_session
    assert session.sent[:len(on_session)] == on_session  # first, and whole
    assert not set(on_session) & set(other.sent)
    assert sorted(session.sent + other.sent) == sorted(COLLECTION)  # every test ran, once
    own = [n for n in other.sent + session.sent if n.startswith("tests/d.py")]
    assert own in ([n for n in other.sent if n.startswith("tests/d.py")],
                   [n for n in session.sent if n.startswith("tests/d.py")])  # a module's tests in one worker
    assert other.shutting_down and session.shutting_down


def test_a_replacement_for_a_lost_session_worker_runs_the_session_group(scheduler):
    other, session = Node("gw1"), Node("gw0")
    for node in (other, session):
        scheduler.add_node(node)
        scheduler.add_node_collection(node, COLLECTION)
    scheduler.schedule()
    scheduler.remove_node(session)  # gw0 crashed before it ran a test: its work goes back to the queue
    replacement = Node("gw2")
    scheduler.add_node(replacement)
    scheduler.add_node_collection(replacement, COLLECTION)
    scheduler.schedule()
    on_session = [n for n in COLLECTION if GROUPS.get(n) == SESSION_GROUP]
    assert set(on_session) <= set(replacement.sent) | set(other.sent)
    assert SESSION_GROUP not in scheduler.workqueue


def test_only_the_session_worker_starts_the_session_cluster(monkeypatch):
    grouped = SimpleNamespace(getoption=lambda name, default=None: "loadgroup", option=SimpleNamespace())
    spread = SimpleNamespace(getoption=lambda name, default=None: "load", option=SimpleNamespace())
    for worker, config, starts in [("gw0", grouped, True), ("gw1", grouped, False), ("gw1", spread, True)]:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        assert xdist_groups.runs_the_session_group(config) is starts, (worker, config)
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert xdist_groups.runs_the_session_group(grouped)  # one process


def test_the_workers_do_not_inherit_the_controllers_airflow_home(monkeypatch, tmp_path):
    """`./scripts/test tests/operators -n 2`: the controller loads tests/operators/conftest.py, whose import of
    tests/airflow_env.py sets RAYSLICE_TEST_AIRFLOW_HOME; workers that inherit it share one metadata DB, and the
    second one's `init_db` copies the migrated DB over the one the first is using."""
    import os

    from tests import conftest

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setenv("RAYSLICE_TEST_AIRFLOW_HOME", str(tmp_path / "the-controllers"))
    monkeypatch.setenv(conftest.SHARED_MIGRATION_ENV, "")  # restored after the test, as the home
    monkeypatch.setattr(conftest.tempfile, "mkdtemp", lambda prefix: str(tmp_path / prefix))
    conftest.pytest_configure(SimpleNamespace(option=SimpleNamespace(numprocesses=2)))
    assert "RAYSLICE_TEST_AIRFLOW_HOME" not in os.environ
