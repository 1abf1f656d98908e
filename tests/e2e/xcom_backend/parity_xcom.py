"""The session Airflow's XCom backend (`[core] xcom_backend`): the parity DAGs' values are kept elsewhere.

What common.io's object-storage backend does with a threshold of 0, with a plain folder: a value
that a `tp_*` DAG (tests/e2e/dags/trigger_parity.py) pushes is written to a file under
``$AIRFLOW_HOME/xcom-elsewhere``, and Airflow's table holds only its reference. A reader that
bypasses the configured backend gets the reference, not the value; a writer that bypasses it
leaves a value in the table, which the parity test finds. Every other DAG's XComs are
`BaseXCom`'s, as without this backend.

It also holds one push: the first `return_value` push of a run whose id starts with `pt-` waits
(in the pushing thread) until the test says go, so a test can freeze a triggerer while it pushes
a step's result (tests/e2e/test_trigger_move.py). Later pushes of that run go through at once.

This folder is on the session Airflow's PYTHONPATH (tests/conftest.py), so the scheduler, the
triggerer and every task process load it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from airflow.sdk import BaseXCom

PREFIX = "elsewhere://"
#: The DAGs whose values are kept elsewhere.
DAG_PREFIX = "tp_"
#: Runs whose first result push is held (`held_push_files`).
HELD_RUN_PREFIX = "pt"
HELD_PUSH_LIMIT_S = 600


def folder(home: str | os.PathLike | None = None) -> Path:
    return Path(home or os.environ["AIRFLOW_HOME"]) / "xcom-elsewhere"


def stored_value(ref: str, home: str | os.PathLike | None = None) -> Any:
    """The value a reference stands for (raises FileNotFoundError for a purged one)."""
    encoded = json.loads((folder(home) / ref.removeprefix(PREFIX)).read_text())
    return BaseXCom.deserialize_value(SimpleNamespace(value=encoded))


def held_push_files(run_id: str, home: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """(created when the held push starts, the test creates it to let the push go on)."""
    base = Path(home or os.environ["AIRFLOW_HOME"]) / "xcom-held"
    return base / f"{run_id}.pushing", base / f"{run_id}.go"


def _hold_first_push(run_id: str) -> None:
    pushing, go = held_push_files(run_id)
    pushing.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(pushing, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # not the first push
    deadline = time.monotonic() + HELD_PUSH_LIMIT_S
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.2)


class ElsewhereXCom(BaseXCom):
    @staticmethod
    def serialize_value(value: Any, *, key: str | None = None, task_id: str | None = None,
                        dag_id: str | None = None, run_id: str | None = None, map_index: int | None = None) -> Any:
        if key == "return_value" and str(run_id or "").startswith(f"{HELD_RUN_PREFIX}-"):
            _hold_first_push(str(run_id))
        if not str(dag_id or "").startswith(DAG_PREFIX):
            return BaseXCom.serialize_value(value)
        name = hashlib.sha256(json.dumps([dag_id, run_id, task_id, map_index, key]).encode()).hexdigest()[:24]
        path = folder() / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(BaseXCom.serialize_value(value)))  # serde's encoding, as the table holds it
        return BaseXCom.serialize_value(f"{PREFIX}{path.name}")

    @staticmethod
    def deserialize_value(result: Any) -> Any:
        value = BaseXCom.deserialize_value(result)
        return stored_value(value) if isinstance(value, str) and value.startswith(PREFIX) else value

    @classmethod
    def purge(cls, xcom: Any, *args: Any) -> None:
        try:
            ref = BaseXCom.deserialize_value(xcom) if xcom is not None and xcom.value is not None else None
        except Exception:
            return
        if isinstance(ref, str) and ref.startswith(PREFIX):
            (folder() / ref.removeprefix(PREFIX)).unlink(missing_ok=True)
