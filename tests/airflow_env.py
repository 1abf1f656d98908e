"""Airflow for the tests: a private AIRFLOW_HOME with SQLite, configured before airflow is imported.

Import this module first in any test conftest that uses Airflow (Airflow reads its
configuration once, at import). Two DAG bundles are configured: the example DAGs in
`dags/`, and `TEST_DAGS`, where tests write DAG files of their own (`dag.test()` only
runs DAGs that live in a bundle).
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import sys
import tempfile
from contextlib import closing
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_DAGS = REPO / "dags"

if "airflow.configuration" in sys.modules and not os.environ.get("RAYSLICE_TEST_AIRFLOW_HOME"):
    raise RuntimeError("airflow was imported before tests/airflow_env.py configured it; import this module first")

HOME = Path(os.environ.setdefault("RAYSLICE_TEST_AIRFLOW_HOME", tempfile.mkdtemp(prefix="rayslice-airflow-")))
TEST_DAGS = HOME / "dags"
TEST_DAGS.mkdir(parents=True, exist_ok=True)

_BUNDLE = "airflow.dag_processing.bundles.local.LocalDagBundle"
os.environ.update({
    "AIRFLOW_HOME": str(HOME),
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    "AIRFLOW__CORE__DAGS_FOLDER": str(TEST_DAGS),
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{HOME}/airflow.db",
    "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps([
        {"name": "dags-folder", "classpath": _BUNDLE, "kwargs": {"path": str(TEST_DAGS)}},
        {"name": "rayslice-examples", "classpath": _BUNDLE, "kwargs": {"path": str(EXAMPLE_DAGS)}},
    ]),
})
_initialized = False
#: The metadata DB as `init_db` left it, before any test wrote to it: `migrated_db` copies it.
MIGRATED = HOME / "migrated.db"


def init_db() -> None:
    """`airflow db migrate`, in process, once per session (an empty SQLite DB: ~20 s), or once per run
    under xdist: a worker after the first copies the first's migrated DB (tests/conftest.py,
    `SHARED_MIGRATION_ENV`)."""
    global _initialized
    if not _initialized:
        from airflow.utils import db

        from tests.conftest import SHARED_MIGRATION_ENV

        shared = os.environ.get(SHARED_MIGRATION_ENV)
        if shared:
            with open(Path(shared) / "lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                first = Path(shared) / "migrated.db"
                if first.exists():
                    from airflow.models import import_all_models

                    import_all_models()  # as `initdb` leaves the process: every model mapped
                    _copy_db(first, HOME / "airflow.db")
                else:
                    db.initdb()
                    _copy_db(HOME / "airflow.db", first.with_suffix(".tmp"))
                    first.with_suffix(".tmp").replace(first)  # whole or not at all, should this worker die
        else:
            db.initdb()
        _initialized = True
        _copy_db(HOME / "airflow.db", MIGRATED)


def _copy_db(source: Path, target: Path) -> None:
    """SQLite's online backup: a consistent copy, with what its write-ahead log holds (a file copy can miss it)."""
    with closing(sqlite3.connect(source)) as src, closing(sqlite3.connect(target)) as dst:
        src.backup(dst)


def migrated_db(path: Path) -> Path:
    """A fresh, migrated metadata DB at `path`, for another Airflow of the tests: a copy of this session's as
    migrated, so each such Airflow does not pay its own migration (20-40 s of a loaded two-core machine).
    Its tables are as `airflow db migrate` leaves them: no run, connection, Variable or DAG of any test."""
    init_db()
    path.parent.mkdir(parents=True, exist_ok=True)
    _copy_db(MIGRATED, path)
    return path


def ray_connection_json(dashboard_url: str, token: str | None = None) -> str:
    """The `ray_default` connection in the JSON form of AIRFLOW_CONN_RAY_DEFAULT, as `rayslice local` gives it."""
    from rayslice.local.local_cluster import ray_connection

    return json.dumps(ray_connection(dashboard_url, token))


# ---------------------------------------------------------------- helpers shared by the Airflow tests


def use_cluster(dashboard_url: str, token: str | None = None) -> None:
    """Point the `ray_default` connection at the test cluster (the JSON env-var form)."""
    os.environ["AIRFLOW_CONN_RAY_DEFAULT"] = ray_connection_json(dashboard_url, token)


def write_dag_file(name: str, source: str) -> Path:
    """A DAG file in the tests' own bundle, so `dag.test()` can run it."""
    path = TEST_DAGS / f"{name}.py"
    path.write_text(source)
    return path


def load_dag_file(path: Path):
    """Parse one DAG file with a real DagBag: (dags by id, import errors by file)."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(path), safe_mode=False)
    return bag.dags, bag.import_errors


def xcom_values(dag_run, task_id: str, key: str = "return_value") -> list:
    """A task's XCom values in map-index order (one item for an unmapped task)."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.scalars(
            XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag_run.dag_id, task_ids=task_id, key=key)
        ).all()
        return [XComModel.deserialize_value(r) for r in sorted(rows, key=lambda r: r.map_index)]


def task_instance(dag_run, task_id: str, map_index: int = -1):
    """The task instance as the metadata DB holds it now: its `id` is the current try's."""
    [ti] = [ti for ti in dag_run.get_task_instances() if ti.task_id == task_id and ti.map_index == map_index]
    return ti


def deployment() -> str:
    """This test Airflow's deployment name (no `deployment` extra here): its Variable, created if no step did yet."""
    from airflow.models.variable import Variable

    return Variable.setdefault("rayslice_deployment", "rayslice-tests")


def task_states(dag_run) -> dict[str, str]:
    return {f"{ti.task_id}[{ti.map_index}]" if ti.map_index >= 0 else ti.task_id: str(ti.state)
            for ti in dag_run.get_task_instances()}


# ---------------------------------------------------------------- fixtures (re-exported by the conftests)


@pytest.fixture(scope="session")
def airflow_db():
    """A migrated Airflow metadata DB (once per session)."""
    init_db()


@pytest.fixture(scope="session")
def ray_default(cluster):
    """`ray_default` → the test cluster, given as AIRFLOW_CONN_RAY_DEFAULT JSON."""
    use_cluster(cluster.dashboard_url, cluster.token)
    return cluster
