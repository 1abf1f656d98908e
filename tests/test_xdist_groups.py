"""The two-worker scheduler (tests/xdist_groups.py): each pinned group runs whole on its own worker only.

Driven the way pytest-xdist drives it (nodes added, collections registered, `schedule`, each test
marked complete), with stand-in worker nodes that record what they were sent.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests import xdist_groups
from tests.conftest import CLUSTER_SIDE_GROUP, SESSION_GROUP

COLLECTION = ["tests/a.py::free_1", "tests/a.py::free_2", "tests/b.py::on_session_1", "tests/b.py::on_session_2",
              "tests/c.py::on_second_1", "tests/d.py::own_cluster_1", "tests/d.py::own_cluster_2",
              "tests/e.py::on_session_3", "tests/a.py::free_3", "tests/f.py::cluster_side_1",
              "tests/f.py::cluster_side_2"]
GROUPS = {"tests/b.py::on_session_1": SESSION_GROUP, "tests/b.py::on_session_2": SESSION_GROUP,
          "tests/e.py::on_session_3": SESSION_GROUP, "tests/c.py::on_second_1": "tests/c.py",
          "tests/d.py::own_cluster_1": "tests/d.py", "tests/d.py::own_cluster_2": "tests/d.py",
          "tests/f.py::cluster_side_1": CLUSTER_SIDE_GROUP, "tests/f.py::cluster_side_2": CLUSTER_SIDE_GROUP}


class Node:
    """A stand-in for xdist's WorkerController: what the scheduler sent it, in order."""

    def __init__(self, worker: str, collection: list[str] = COLLECTION) -> None:
        self.gateway = SimpleNamespace(id=worker)
        self.sent: list[str] = []
        self.shutting_down = False
        self.collection = collection

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent.extend(self.collection[i] for i in indexes)

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


def run(scheduler, *nodes: Node, registered: bool = False, collection: list[str] = COLLECTION,
        first_ahead: bool = False) -> None:
    """Register the nodes (unless they are), schedule, then complete each node's tests in turn until nothing
    is left, as xdist's workers do: a worker runs a test only once it knows the next one or that none comes
    (`shutdown`), so a worker never told either holds its last test for ever, and the run never ends.
    `first_ahead`: the first node runs every test it can before the others run any more (a slow other worker)."""
    for node in () if registered else nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, collection)
    scheduler.schedule()
    done = {node: 0 for node in nodes}
    progress = True
    while progress:
        progress = False
        for node in nodes:  # one test each, alternately: two workers progressing at once
            if done[node] < len(node.sent) and (done[node] + 1 < len(node.sent) or node.shutting_down):
                scheduler.mark_test_complete(node, collection.index(node.sent[done[node]]))
                done[node] += 1
                progress = True
                if first_ahead:
                    break
    held = {node.gateway.id: node.sent[done[node]:] for node in nodes if done[node] < len(node.sent)}
    assert not held, f"workers left holding tests, never told to stop: {held}"
    assert all(node.shutting_down for node in nodes)


def test_each_pinned_group_runs_whole_in_order_on_its_worker_only_after_every_cluster_free_test(scheduler):
    other, session = Node("gw1"), Node("gw0")  # the other worker registers first
    run(scheduler, other, session)
    free = {n for n in COLLECTION if n not in GROUPS}
    for group, node, not_there in [(SESSION_GROUP, session, other), (CLUSTER_SIDE_GROUP, other, session)]:
        tests = [n for n in COLLECTION if GROUPS.get(n) == group]
        start = node.sent.index(tests[0])
        assert node.sent[start:start + len(tests)] == tests  # whole, in order
        assert set(node.sent[:start]) <= free  # cluster-free tests while its cluster starts, nothing else
        assert not set(tests) & set(not_there.sent)
    for node in (session, other):  # as in one process: no cluster-free test after a test on a cluster
        last_free = max((i for i, n in enumerate(node.sent) if n in free), default=-1)
        assert all(n in free for n in node.sent[:last_free + 1]), node.sent
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
    crashed = scheduler.remove_node(session)  # gw0 died: xdist reports its first test failed, the rest go back
    replacement = Node("gw2")
    scheduler.add_node(replacement)
    scheduler.add_node_collection(replacement, COLLECTION)
    run(scheduler, other, replacement, registered=True)
    on_session = [n for n in COLLECTION if GROUPS.get(n) == SESSION_GROUP]
    assert set(on_session) <= set(replacement.sent) | set(other.sent)
    assert sorted([*other.sent, *replacement.sent, crashed]) == sorted(COLLECTION)  # nothing lost with gw0
    assert not scheduler.workqueue


def test_each_worker_knows_its_pinned_group_and_so_which_session_cluster_to_start(monkeypatch):
    grouped = SimpleNamespace(getoption=lambda name, default=None: "loadgroup", option=SimpleNamespace())
    spread = SimpleNamespace(getoption=lambda name, default=None: "load", option=SimpleNamespace())
    for worker, config, group in [("gw0", grouped, SESSION_GROUP), ("gw1", grouped, CLUSTER_SIDE_GROUP),
                                  ("gw2", grouped, xdist_groups.NO_GROUP), ("gw1", spread, None)]:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        assert xdist_groups.pinned_group_here(config) == group, (worker, config)
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert xdist_groups.pinned_group_here(grouped) is None  # one process: any test


def test_a_worker_left_with_only_another_workers_group_is_told_to_stop_with_tests_in_hand(scheduler, monkeypatch):
    """gw1 runs every test it may while gw0 sits on its first ones: only gw0's group is left, which gw1 may not
    run, and gw1 still holds its last test; unless told to stop now it never runs it (`run` fails)."""
    other, session = Node("gw1"), Node("gw0")
    run(scheduler, other, session, first_ahead=True)
    assert sorted(session.sent + other.sent) == sorted(COLLECTION)


@pytest.mark.parametrize("first", ["gw0", "gw1"])
def test_fewer_units_than_workers_keeps_the_worker_pinned_to_the_one_there(scheduler, first):
    """`-k on_session`: one unit, two workers. xdist sends home the last worker to register; here never the
    worker pinned to that unit, whichever registered last."""
    only_session = [n for n in COLLECTION if GROUPS.get(n) == SESSION_GROUP]
    nodes = {"gw0": Node("gw0"), "gw1": Node("gw1")}
    for node in nodes.values():
        node.collection = only_session
    order = [nodes[first], nodes["gw1" if first == "gw0" else "gw0"]]
    run(scheduler, *order, collection=only_session)
    assert nodes["gw0"].sent == only_session
    assert nodes["gw1"].sent == []


def test_a_reused_cluster_makes_one_group_of_every_test_on_it(monkeypatch):
    """RAYSLICE_TEST_CLUSTER: both session groups would run at once on the one cluster's slices."""
    from tests import conftest

    def item(module: str, fixtures: tuple[str, ...]):
        defs = {name: [SimpleNamespace(scope="session")] for name in fixtures}
        return SimpleNamespace(nodeid=f"{module}::t", fixturenames=fixtures, get_closest_marker=lambda mark: None,
                               _fixtureinfo=SimpleNamespace(name2fixturedefs=defs))

    items = [item("tests/rayslice/cluster/test_x.py", ("cluster",)), item("tests/operators/test_y.py", ("cluster",))]
    monkeypatch.delenv("RAYSLICE_TEST_CLUSTER", raising=False)
    assert set(conftest.groups(items).values()) == {SESSION_GROUP, CLUSTER_SIDE_GROUP}
    monkeypatch.setenv("RAYSLICE_TEST_CLUSTER", "reused")
    assert set(conftest.groups(items).values()) == {SESSION_GROUP}


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


@pytest.mark.parametrize(("arguments", "environment", "added"), [
    ([], {}, ["-n", "2", "--dist", "loadgroup"]),
    (["-m", "not cluster"], {}, ["-n", "2", "--dist", "loadgroup"]),
    (["-n", "3"], {}, ["--dist", "loadgroup"]),  # more workers, the same grouping
    (["-n3"], {}, ["--dist", "loadgroup"]),
    (["-n", "2", "--dist", "load"], {}, []),  # the caller's own distribution
    (["--pdb"], {}, []),  # a debugger needs the terminal: one process
    (["-p", "no:xdist"], {}, []),
    (["-s"], {}, []),
    ([], {"RAYSLICE_TEST_CLUSTER": "mine"}, []),  # one reused cluster: one process
    (["-n", "2"], {"RAYSLICE_TEST_CLUSTER": "mine"}, ["--dist", "loadgroup"]),  # asked for: grouped, one group
    # PYTEST_ADDOPTS is the caller's too: pytest reads it ahead of the command line.
    ([], {"PYTEST_ADDOPTS": "--pdb"}, []),  # else: "--pdb is incompatible with distributing tests"
    ([], {"PYTEST_ADDOPTS": "-p no:xdist"}, []),  # else: "unrecognized arguments: -n"
    ([], {"PYTEST_ADDOPTS": "-n0"}, ["--dist", "loadgroup"]),  # else the command line's -n 2 overrides it
    ([], {"PYTEST_ADDOPTS": "-n 2", "RAYSLICE_TEST_CLUSTER": "mine"}, ["--dist", "loadgroup"]),  # else xdist's
    # `load`: the reused cluster's tests on two workers at once
])
def test_scripts_test_runs_two_grouped_workers_unless_the_arguments_choose(tmp_path, arguments, environment, added):
    """scripts/test's own arguments to pytest, ahead of the caller's, run against a stand-in `.venv`."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "scripts").mkdir()
    shutil.copy(root / "scripts" / "test", tmp_path / "scripts" / "test")
    stand_ins = {"scripts/bootstrap": "#!/bin/sh\n", ".venv/bin/python": '#!/bin/sh\nprintf "%s\\n" "$@"\n',
                 "bin/chromium": "#!/bin/sh\n"}
    for name, text in stand_ins.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key not in ("RAYSLICE_TEST_CLUSTER", "PYTEST_ADDOPTS")}
    env |= environment | {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}"}
    run = subprocess.run([str(tmp_path / "scripts" / "test"), *arguments], env=env, capture_output=True, text=True,
                         check=True)
    assert run.stdout.splitlines() == ["-m", "pytest", *added, *arguments]


def test_the_test_a_worker_crashed_on_is_reported_once_and_not_run_again(scheduler):
    """xdist reports the test a worker died on as failed (`handle_crashitem`); its loadscope scheduler then puts
    it back in the queue with the rest of its unit, so the replacement runs it again: a test reported twice, and a
    test that kills its worker kills every replacement in turn (each starting, and leaving running, a session
    cluster of its own) until `--max-worker-restart`."""
    on_clusters = [n for n in COLLECTION if n in GROUPS]  # no cluster-free test: gw0 starts on its group
    other, session = Node("gw1", on_clusters), Node("gw0", on_clusters)
    for node in (other, session):
        scheduler.add_node(node)
        scheduler.add_node_collection(node, on_clusters)
    scheduler.schedule()
    on_session = [n for n in on_clusters if GROUPS.get(n) == SESSION_GROUP]
    assert session.sent[:3] == on_session
    scheduler.mark_test_complete(session, on_clusters.index(on_session[0]))
    crashed = scheduler.remove_node(session)  # gw0 dies running the group's second test
    assert crashed == on_session[1]
    replacement = Node("gw2", on_clusters)
    scheduler.add_node(replacement)
    scheduler.add_node_collection(replacement, on_clusters)
    run(scheduler, other, replacement, registered=True, collection=on_clusters)
    again = other.sent + replacement.sent
    assert crashed not in again
    assert sorted([*again, *on_session[:2]]) == sorted(on_clusters)  # the rest, once each


def _pytest(tmp_path, *arguments: str, **env: str):
    """A pytest of this repository's suite in a process of its own, its temporary folders under `tmp_path/tmp`."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "tmp").mkdir(exist_ok=True)
    environ = {key: value for key, value in os.environ.items() if not key.startswith(("RAYSLICE_TEST_", "PYTEST_"))}
    environ |= {"TMPDIR": str(tmp_path / "tmp"), **env}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *arguments],
                          cwd=Path(__file__).resolve().parents[1], env=environ, capture_output=True, text=True,
                          timeout=120)


def test_a_run_removes_only_the_shared_folders_it_made(tmp_path):
    """A variable left set (a shell that copied a worker's environment) names a folder this run did not make: a
    run in one process removed it, whatever it held."""
    from tests.conftest import SHARED_MIGRATION_ENV

    kept = {name: tmp_path / name for name in (xdist_groups.GROUPS_ENV, SHARED_MIGRATION_ENV)}
    for folder in kept.values():
        folder.mkdir()
        (folder / "precious").write_text("")
    run = _pytest(tmp_path, "-n", "0", "--collect-only", "-q", "tests/test_xdist_groups.py",
                  **{name: str(folder) for name, folder in kept.items()})
    assert run.returncode == 0, run.stdout + run.stderr
    assert [name for name, folder in kept.items() if not (folder / "precious").exists()] == []


def test_xdist_turned_off_runs_the_suite_in_one_process(tmp_path):
    """`./scripts/test -p no:xdist` (README: one process): xdist's hooks are then unknown, and pytest refused the
    scheduler's hook at collection (INTERNALERROR, "unknown hook 'pytest_xdist_make_scheduler'")."""
    run = _pytest(tmp_path, "-p", "no:xdist", "tests/test_xdist_groups.py", "-k", "reused_cluster")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout, run.stdout


@pytest.mark.parametrize("option", ["--markers", "--help"])
def test_a_run_without_a_session_leaves_no_shared_folder_behind(tmp_path, option):
    """`./scripts/test --markers` (two workers by default): pytest configures, shows, unconfigures; no session,
    so no `pytest_sessionfinish` to remove the shared migration folder."""
    run = _pytest(tmp_path, "-n", "2", "--dist", "loadgroup", option)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(path.name for path in (tmp_path / "tmp").iterdir()) == []


def test_a_controller_with_a_worker_name_left_in_its_environment_still_shares_its_folders(monkeypatch, tmp_path):
    """PYTEST_XDIST_WORKER left set (a shell started from a worker): the controller took itself for a worker, made
    no groups folder (so no groups: the session's tests spread over both workers, each starting the session
    Airflow) and no shared migration, and let its workers inherit its Airflow home."""
    import os

    from tests import conftest

    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setenv(xdist_groups.GROUPS_ENV, "")
    monkeypatch.setenv(conftest.SHARED_MIGRATION_ENV, "")
    monkeypatch.setenv("RAYSLICE_TEST_AIRFLOW_HOME", str(tmp_path / "the-controllers"))
    made = []
    monkeypatch.setattr(xdist_groups.tempfile, "mkdtemp", lambda prefix: made.append(prefix) or str(tmp_path / prefix))
    controller = SimpleNamespace(option=SimpleNamespace(numprocesses=2),
                                 getoption=lambda name, default=None: "loadgroup")  # no `workerinput`
    xdist_groups.pytest_configure(controller)
    conftest.pytest_configure(controller)
    assert sorted(made) == ["rayslice-migrated-db-", "rayslice-test-groups-"]
    assert os.environ[xdist_groups.GROUPS_ENV] == str(tmp_path / "rayslice-test-groups-")
    assert "RAYSLICE_TEST_AIRFLOW_HOME" not in os.environ


def test_the_session_cluster_of_a_worker_that_died_is_stopped(monkeypatch, tmp_path):
    """A worker that dies (killed for memory, a crash in a Ray driver) never reaches `pytest_sessionfinish`, so its
    session cluster ran on after the run, and xdist's replacement started another."""
    import os

    from tests import conftest

    home = tmp_path / "popen-gw0" / "rayslice-home0"
    (home / "clusters").mkdir(parents=True)
    (home / "clusters" / "pytest-123.json").write_text("{}")
    stopped = []
    monkeypatch.setattr(conftest.local_cluster, "down",
                        lambda name: stopped.append((name, os.environ["RAYSLICE_HOME"])))
    factory = SimpleNamespace(getbasetemp=lambda: tmp_path)
    for worker, error in [("gw1", "crashed"), ("gw0", None), ("gw0", "crashed")]:
        node = SimpleNamespace(gateway=SimpleNamespace(id=worker), config=SimpleNamespace(_tmp_path_factory=factory))
        conftest.pytest_testnodedown(node=node, error=error)
    assert stopped == [("pytest-123", str(home))]
