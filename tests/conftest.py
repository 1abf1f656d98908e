"""Shared fixtures: one real local Ray cluster per test session (two v6e-16, one v6e-4, 3 GPUs).

Set RAYSLICE_TEST_CLUSTER=<name> to reuse a cluster of the same shape, started with
`rayslice local up --name <name> --tpu v6e-16 --tpu v6e-16 --tpu v6e-4 --gpus 3` (handy while
developing); otherwise the session starts its own on free ports, in the background while the
cluster-free tests run first, and stops it, by PID, at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

#: The suite's processes cache bytecode even where PYTHONDONTWRITEBYTECODE is set (as on the CI machine and
#: this project's, BENCHMARKS.md §8): otherwise every xdist worker compiles and assertion-rewrites every test
#: module at collection (a cluster-free collection: 9-10 CPU-s from source, 4.6 cached), and every CLI,
#: Airflow and Ray process a test starts compiles rayslice again. Only the repository's own modules are
#: affected (`scripts/bootstrap` compiles .venv's); `__pycache__` is git-ignored, and what the product ships
#: (working_dir uploads, packages, the Docker context) leaves it out.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from rayslice.local import local_cluster, processes  # noqa: E402  (after the bytecode setting above)

#: The slowest tests and each directory's total at the end of every run, and the suite's time budget.
#: Two workers for the whole suite (scripts/test), with what must share a process kept together.
pytest_plugins = ["tests.timing_report", "tests.xdist_groups"]

TEST_SPEC = local_cluster.ClusterSpec(tpus=("v6e-16", "v6e-16", "v6e-4"), gpus=3)
TOTAL_TPU_CHIPS = 36

#: Fixtures that start or use a local Ray cluster, and those that start a whole Airflow or a browser.
#: A test that needs any of them (directly or through another fixture) gets the matching mark, so
#: `-m "not cluster"` is the fast loop: everything that runs without a cluster.
CLUSTER_FIXTURES = {"cluster", "small_cluster", "autoscaling_cluster", "token_cluster", "ray_driver", "_head_factory",
                    "wheel_cluster", "cluster_pair"}
AIRFLOW_FIXTURES = {"airflow", "airflow_stack"}
BROWSER_FIXTURES = {"browser"}


#: The groups of tests that one xdist worker each runs whole, in order, under `--dist loadgroup` (two workers,
#: `scripts/test`'s default), each on a session cluster of its own (tests/xdist_groups.py): the tests on the
#: session's Airflow (and every other module on the session's cluster), and the launcher's own tests on the
#: cluster (`CLUSTER_SIDE_MODULES`, which need no Airflow) on a second session cluster beside them.
SESSION_GROUP = "session"
CLUSTER_SIDE_GROUP = "session-cluster-side"
CLUSTER_SIDE_MODULES = "tests/rayslice/cluster/"
#: Which worker runs each of those groups (another one only once that worker is gone).
PINNED_GROUPS = {SESSION_GROUP: "gw0", CLUSTER_SIDE_GROUP: "gw1"}
#: The session-scoped fixtures that are, or stand on, the session's cluster.
SESSION_CLUSTER_FIXTURES = ("cluster", "ray_driver")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        needs = set(getattr(item, "fixturenames", ()))
        if needs & CLUSTER_FIXTURES:
            item.add_marker(pytest.mark.cluster)
        if needs & AIRFLOW_FIXTURES:
            item.add_marker(pytest.mark.airflow)
        if needs & BROWSER_FIXTURES or item.get_closest_marker("browser"):
            item.add_marker(pytest.mark.browser)
    # Cluster-free tests first: the session's cluster starts in the background meanwhile
    # (`pytest_collection_finish`), so its minute or two of start-up overlaps them.
    items[:] = ([item for item in items if not item.get_closest_marker("cluster")]
                + [item for item in items if item.get_closest_marker("cluster")])
    # The tests that use the session's Airflow run one after another (in their files' order), so it
    # can stop after the last of them instead of idling through the rest of the session; likewise the
    # tests over two clusters (`cluster_pair`), which stop the pair after the last of them. A test over
    # both sits where the two runs meet: the Airflow's last tests, then the pair's first.
    on_airflow = [item for item in items if _uses_session_airflow(item)]
    on_pair = [item for item in items if _uses_cluster_pair(item)]
    both = [item for item in on_airflow if item in on_pair]
    block = ([item for item in on_airflow if item not in both] + both
             + [item for item in on_pair if item not in both])
    from tests import xdist_groups  # loaded (and assert-rewritten) by `pytest_plugins` by now

    if block and xdist_groups.active(config):
        # Two workers: the other one's private clusters start and run beside the session's first tests, so
        # the session Airflow's end-to-end tests, the ones most sensitive to a busy machine, come last.
        items[:] = [item for item in items if item not in block] + block
    elif block:
        first = min(items.index(item) for item in block)
        rest = [item for item in items if item not in block]
        before = [item for item in rest if items.index(item) < first]
        items[:] = before + block + rest[len(before):]


def groups(items: list[pytest.Item]) -> dict[str, str]:
    """Which tests must run in one process when two xdist workers share the suite (tests/xdist_groups.py).

    The tests on a session's cluster share its slices, so they cannot overlap: one worker runs the
    session's cluster and Airflow and every module that touches either (`SESSION_GROUP`), one test
    after another as a single process would, and the other worker runs the cluster-side modules that need
    no Airflow (`CLUSTER_SIDE_GROUP`) the same way on a session cluster of its own. Beside them, whichever
    worker is free runs the rest: the cluster-free tests one by one, and each module that starts a cluster
    or an Airflow of its own, whole (its tests share that module fixture). The tests over two clusters
    (`cluster_pair`, started once per process) go together, in the session's group when one of them also
    uses the session's Airflow. (One session cluster left the other worker idle for two thirds of the run:
    BENCHMARKS.md, the test suite's time.)
    """
    session_modules = {_module(item) for item in items if _uses_session_cluster(item) or _uses_session_airflow(item)}
    if any(_uses_session_airflow(item) and _uses_cluster_pair(item) for item in items):
        session_modules |= {_module(item) for item in items if _uses_cluster_pair(item)}
    beside_airflow = {_module(item) for item in items if _uses_session_airflow(item) or _uses_cluster_pair(item)}
    cluster_side = {module for module in session_modules
                    if module.startswith(CLUSTER_SIDE_MODULES) and module not in beside_airflow}
    if os.environ.get("RAYSLICE_TEST_CLUSTER"):
        cluster_side = set()  # one reused cluster: its slices are shared, so its tests run one after another
    found = {}
    for item in items:
        module = _module(item)
        if module in cluster_side:
            found[item.nodeid] = CLUSTER_SIDE_GROUP
        elif module in session_modules:
            found[item.nodeid] = SESSION_GROUP
        elif _uses_cluster_pair(item):
            found[item.nodeid] = "cluster-pair"
        elif any(item.get_closest_marker(mark) for mark in ("cluster", "airflow", "browser")):
            found[item.nodeid] = module
    return found


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def _uses_session_cluster(item: pytest.Item) -> bool:
    fixture = getattr(item, "_fixtureinfo", None)
    for name in SESSION_CLUSTER_FIXTURES:
        defs = fixture.name2fixturedefs.get(name, ()) if fixture else ()
        if defs and defs[-1].scope == "session":  # the closest definition: a module may have its own `cluster`
            return True
    return False


def _uses_session_airflow(item: pytest.Item) -> bool:
    fixture = getattr(item, "_fixtureinfo", None)
    defs = fixture.name2fixturedefs.get("airflow", ()) if fixture else ()
    return bool(defs) and defs[-1].scope == "session"


def _uses_cluster_pair(item: pytest.Item) -> bool:
    return "cluster_pair" in getattr(item, "fixturenames", ())


_session_airflow: list = []  # how to stop the running stack, so the last test that uses it can


@pytest.hookimpl(trylast=True)  # after the item's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _session_airflow and _uses_session_airflow(item) and (nextitem is None or not _uses_session_airflow(nextitem)):
        _session_airflow.pop()()
    over_two = _uses_cluster_pair(item)
    next_over_two = nextitem is not None and _uses_cluster_pair(nextitem)
    if _cluster_pair and over_two and not next_over_two:
        _cluster_pair.pop()()


_cluster_pair: list = []  # how to stop the two clusters, so the last test over them can


_cluster_start: dict = {}  # the session's cluster, starting in the background: its process, home and name


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the session's cluster now, in its own process, if any selected test needs it.

    The cluster-free tests run first (`pytest_collection_modifyitems`) while it starts; under two workers,
    the other worker's tests do. A process, not a thread: it reads `RAYSLICE_HOME` throughout, which tests
    may change meanwhile.
    """
    if os.environ.get("RAYSLICE_TEST_CLUSTER") or session.config.option.collectonly:
        return
    from tests import xdist_groups

    here = xdist_groups.pinned_group_here(session.config)  # None: every test may run here
    mine = groups(session.items) if here else {}
    if not any("cluster" in getattr(item, "fixturenames", ()) and (here is None or mine.get(item.nodeid) == here)
               for item in session.items):
        return  # no test here needs it (a worker of a grouped run without a session group of its own runs none)
    _start_session_cluster(session.config._tmp_path_factory.mktemp("rayslice-home"))


def _start_session_cluster(home: Path) -> dict:
    name = f"pytest-{os.getpid()}"
    spec = TEST_SPEC
    code = ("import sys; from rayslice.local import local_cluster as c; c.up(c.ClusterSpec(tpus="
            f"{spec.tpus!r}, gpus={spec.gpus}, head_cpus={spec.head_cpus}, host_cpus={spec.host_cpus}), "
            "name=sys.argv[1])")
    log = home / "session-cluster-up.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-c", code, name], stdout=out, stderr=subprocess.STDOUT,
                                   env=os.environ | {"RAYSLICE_HOME": str(home)})
    _cluster_start.update(process=process, home=home, name=name, log=log, stopped=False)
    return _cluster_start


def _stop_session_cluster() -> None:
    """Stop the session's cluster by PID (once), after its start-up process ended either way."""
    if _cluster_start and not _cluster_start["stopped"]:
        _cluster_start["stopped"] = True
        _cluster_start["process"].wait()
        with rayslice_home(_cluster_start["home"]):
            if (local_cluster.state_dir() / f"{_cluster_start['name']}.json").exists():  # a failed `up` stopped itself
                local_cluster.down(_cluster_start["name"])


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown under `-p no:xdist`
def pytest_testnodedown(node, error) -> None:
    """In the controller: a worker that died (xdist replaces it) never stopped its session cluster; stop it.

    Its records lie in the worker's own temporary folder (`pytest_collection_finish`). A cluster whose `up` was
    still running when the worker died is recorded only once it is up, after this: that one is still left.
    """
    if error is None:
        return
    worker_temp = Path(node.config._tmp_path_factory.getbasetemp()) / f"popen-{node.gateway.id}"
    for record in sorted(worker_temp.glob("rayslice-home*/clusters/pytest-*.json")):
        with rayslice_home(record.parent.parent), contextlib.suppress(Exception):
            local_cluster.down(record.stem)


#: A folder the xdist workers of one run share, so the first to need Airflow's metadata DB migrates it and
#: the other copies it (tests/airflow_env.py, `init_db`): one migration per run, not one per worker.
SHARED_MIGRATION_ENV = "RAYSLICE_TEST_MIGRATED_DB"


def pytest_configure(config: pytest.Config) -> None:
    from tests import xdist_groups

    if getattr(config.option, "numprocesses", None) and xdist_groups.is_controller(config):
        # The controller, before it starts the workers (they inherit its environment).
        xdist_groups.share_folder(SHARED_MIGRATION_ENV, "rayslice-migrated-db-")
        # Each worker an Airflow home (metadata DB, DAG folder) of its own: a conftest the controller loaded for
        # a folder argument (`./scripts/test tests/operators -n 2`) imported tests/airflow_env.py, which set it here.
        os.environ.pop("RAYSLICE_TEST_AIRFLOW_HOME", None)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _stop_session_cluster()  # started in the background, but no test asked for it (all skipped, Ctrl-C)


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    """What a test did to this process's SIGINT and SIGTERM handlers ends with it.

    Airflow's `dag.test()` leaves its task runner's SIGTERM handler installed in this process (found by checking
    every cluster-free test's handlers); a later test that signals this process would reach that handler.
    """
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in before.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)


@pytest.fixture(scope="session")
def cluster():
    reuse = os.environ.get("RAYSLICE_TEST_CLUSTER")
    if reuse:
        yield local_cluster.ClusterRecord.load(reuse)
        return
    start = _cluster_start or _start_session_cluster(Path(tempfile.mkdtemp(prefix="rayslice-home-")))
    assert start["process"].wait() == 0, f"the session's cluster did not start:\n{start['log'].read_text()[-4000:]}"
    with rayslice_home(start["home"]):
        record = local_cluster.ClusterRecord.load(start["name"])
    os.environ["RAYSLICE_HOME"] = str(start["home"])  # for the whole session: the CLI tests find it there
    try:
        yield record
    finally:
        _stop_session_cluster()  # whatever a module fixture did to RAYSLICE_HOME, stop *this* cluster
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
def cluster_pair(tmp_path_factory):
    """Two small private clusters for steps over several clusters (tests/cluster_pair.py), stopped after the last
    test over them (they run one after another: `pytest_collection_modifyitems`).

    Under a home of their own only while they start and stop: meanwhile `RAYSLICE_HOME` stays the session's.
    """
    from tests.cluster_pair import NAMES, SHAPE, Pair

    home = tmp_path_factory.mktemp("set-home")
    records = []

    def stop() -> None:
        with rayslice_home(home):
            while records:
                local_cluster.down(records.pop().name)

    try:
        for name in NAMES:
            with rayslice_home(home):
                try:
                    records.append(local_cluster.up(SHAPE, name=name))
                except Exception:  # a loaded 2-core machine can miss a node's start-up deadline once
                    with contextlib.suppress(Exception):
                        local_cluster.down(name)
                    records.append(local_cluster.up(SHAPE, name=name))
        _cluster_pair.append(stop)  # the last test over them stops them (`pytest_runtest_teardown`)
        yield Pair(*records, shared=home / "shared", home=home)
    finally:
        if stop in _cluster_pair:
            _cluster_pair.remove(stop)
        stop()


@pytest.fixture(scope="session")
def ray_driver(cluster):
    """This process as a Ray driver on the test cluster (cluster-side tests only)."""
    import ray

    for key, value in cluster.ray_env().items():
        os.environ.setdefault(key, value)
    ray.init(address=cluster.gcs_address, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


#: The scheduler gives up on a task whose worker stopped heartbeating after this long (default 300 s):
#: short, so the reaper test's killed worker is noticed; long enough for a loaded two-core machine.
HEARTBEAT_TIMEOUT_S = 30


@pytest.fixture(scope="session")
def airflow(cluster, tmp_path_factory: pytest.TempPathFactory):
    """One real Airflow for every test that needs one, started as a user starts it (`rayslice airflow up`).

    Each start costs ~90 s of a two-core machine, so the end-to-end, browser and reaper tests share
    it. Its DAG folder holds the repo's example DAGs and the end-to-end tests' DAGs, parsed from its
    start on (a file added later waits for the dag-processor's next look, every 5 s, and its parse); a
    test may still add a DAG file of its own there (`tests/e2e/conftest.py:add_dags`). A DAG file is
    parsed when it is new or changed, not again every 30 s (`min_file_process_interval`): re-parsing a
    dozen unchanged files would take a steady share of a two-core machine from every test meanwhile.
    The last test that uses it stops it (`pytest_runtest_teardown`) with `rayslice airflow down`, which
    must leave no process of it and the session's cluster running.
    """
    from rayslice.local import airflow_ui, local_cluster
    from tests.airflow_cli import CliAirflow
    from tests.airflow_env import REPO

    dags = tmp_path_factory.mktemp("airflow-dags")
    for source in [*(REPO / "dags").glob("[!_]*.py"),
                   *(REPO / "tests/e2e/dags" / name for name in ("lifecycle.py", "shared_cluster.py", "shared_day.py",
                                                                 "trigger_parity.py", "trigger_start.py"))]:
        shutil.copy(source, dags / source.name)
    settings = {"AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_S),
                "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "3",
                "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",
                # The parity DAGs' XComs are kept elsewhere, as a custom XCom backend keeps them (every other
                # DAG's as without one): tests/e2e/xcom_backend/parity_xcom.py.
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests/e2e/xcom_backend"),
                                                            os.environ.get("PYTHONPATH")])),
                "AIRFLOW__CORE__XCOM_BACKEND": "parity_xcom.ElsewhereXCom"}
    stack = CliAirflow(f"session-{os.getpid()}", cluster.name, dags, settings)
    stack.first_up = stack.up()

    def stop() -> None:
        record = airflow_ui.UiRecord.load(stack.name)
        if record is not None:
            stack.down()
            assert not airflow_ui.processes(record), "processes of `rayslice airflow up` left after down"
        assert local_cluster.alive_nodes(cluster.dashboard_url, cluster.token), "down stopped the session's cluster"

    _session_airflow.append(stop)
    try:
        assert {"scheduler", "triggerer", "api-server", "dag-processor"} <= set(stack.record.sessions)
        yield stack
    finally:
        if _session_airflow:  # the run stopped early (-x, Ctrl-C, an error before its last user)
            _session_airflow.pop()()


def end_sessions(*leaders: subprocess.Popen) -> None:
    """Kill everything in the leaders' sessions (processes started with `start_new_session`), then reap the leaders."""
    for pid in processes.session_members({leader.pid for leader in leaders}):
        processes.send_signal(pid, signal.SIGKILL)
    for leader in leaders:
        leader.kill()
        leader.wait(timeout=10)


def wait_until(condition, timeout: float = 10.0, interval: float = 0.05):
    """Poll `condition` until it is truthy; returns its last value (tests assert on it)."""
    deadline = time.monotonic() + timeout
    value = condition()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = condition()
    return value


#: The project's reference files (KubeRay's CRDs and TPU sample): `shared/reference` beside the repository.
REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference"
REFERENCE_CRDS = ("kuberay-crd-rayclusters.yaml", "kuberay-crd-rayjobs.yaml")


def reference_file(name: str) -> Path:
    """A file of `REFERENCE`. Missing: a skip on a developer's machine, a failure under CI (`CI` set),
    so a green CI run always means the tests that need it ran."""
    path = REFERENCE / name
    if not path.is_file():
        message = f"reference file {path} is missing (the tests that check against KubeRay's real CRDs need it)"
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def reference_crds() -> list[Path]:
    """KubeRay's real RayCluster and RayJob CRD files."""
    return [reference_file(name) for name in REFERENCE_CRDS]


#: KubeRay releases whose CRDs `shared/reference/kuberay-crds/<release>/` holds (ray.io_rayclusters/rayjobs.yaml).
KUBERAY_RELEASES = ("v1.5.1", "v1.6.2", "v1.7.0")


def kuberay_release_crds(release: str) -> list[Path]:
    """One KubeRay release's RayCluster and RayJob CRD files; missing, a skip here and a failure under CI."""
    return [reference_file(f"kuberay-crds/{release}/ray.io_{plural}.yaml") for plural in ("rayclusters", "rayjobs")]
