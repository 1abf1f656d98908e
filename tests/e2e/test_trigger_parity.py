"""A step started in the triggerer ends exactly as one started on a worker (issue 36): the parity suite.

One DAG, twice (tests/e2e/dags/trigger_parity.py): `tp_trigger` with default steps, `tp_worker`
with `deferrable=False`, run at the same time through the session's real scheduler and triggerer.
Then the step `flip` is cleared with its downstream tasks, and its next tries fail (the run's conf
names a marker file, created now). Both runs must agree on every task instance's state and try,
what each task pushed (so what downstream tasks read), the TaskMap rows the scheduler expanded
mapped tasks from, the callbacks fired, and the `@@` lines each step printed in its task log.
The session Airflow's XCom backend keeps these DAGs' values elsewhere (`parity_xcom`): every
value read here is read through it, and one found in Airflow's own table was written past it.
Both runs start at once and are waited for together (one Airflow, one wait).

No difference in what a task ends with is forced by Airflow; docs/concepts.md says where the two
paths differ in how: which process runs a callback, and which steps run on a worker anyway.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import httpx
import pytest

from tests.airflow_cli import get_json
from tests.conftest import wait_until
from tests.e2e.conftest import add_dags
from tests.e2e.xcom_backend import parity_xcom

DAGS = Path(__file__).parent / "dags" / "trigger_parity.py"
MODES = ("trigger", "worker")
#: `@@` lines a step prints, as they appear in its task log.
HOST_LINE = re.compile(r"@@ [A-Za-z_]+(?: [0-9A-Za-z_-]+)?")

pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def api(airflow, airflow_api):
    return add_dags(airflow, airflow_api, DAGS, [f"tp_{mode}" for mode in MODES])


def _state(api: httpx.Client, dag_id: str, run_id: str) -> str | None:
    return (get_json(api, f"/dags/{dag_id}/dagRuns/{run_id}") or {}).get("state")  # None: poll again


def _wait_ended(api: httpx.Client, runs: dict[str, str], timeout: float) -> None:
    ended = wait_until(lambda: all(_state(api, d, r) in ("success", "failed") for d, r in runs.items()),
                       timeout=timeout, interval=1)
    assert ended, {d: _state(api, d, r) for d, r in runs.items()}


def _tis(api: httpx.Client, dag_id: str, run_id: str) -> list[dict]:
    return api.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 100}).json()["task_instances"]


def _xcom(api: httpx.Client, home: Path, dag_id: str, run_id: str, task_id: str, key: str, map_index: int):
    """What a downstream task reads: the stored value, through the session's XCom backend (`parity_xcom`)."""
    resp = api.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}",
                   params={"map_index": map_index, "deserialize": True})
    if resp.status_code == 404:
        return "<none>"
    resp.raise_for_status()
    value = resp.json()["value"]
    try:
        value = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        pass
    if not (isinstance(value, str) and value.startswith(parity_xcom.PREFIX)):
        return ("in Airflow's table, not through the XCom backend", value)
    try:
        return parity_xcom.stored_value(value, home)
    except FileNotFoundError:
        return ("purged", value)


def _host_lines(api: httpx.Client, dag_id: str, run_id: str, ti: dict) -> list[str]:
    lines: set[str] = set()
    for try_number in range(1, ti["try_number"] + 1):
        resp = api.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{ti['task_id']}/logs/{try_number}",
                       params={"map_index": ti["map_index"], "full_content": True})
        resp.raise_for_status()  # a log that cannot be read is not a log without the line
        content = "\n".join(json.dumps(e) if isinstance(e, dict) else str(e) for e in resp.json()["content"])
        lines |= {f"try {try_number}: {line}" for line in HOST_LINE.findall(content)}
    return sorted(lines)


def _task_maps(db: Path, dag_id: str, run_id: str) -> list[tuple]:
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as conn:
        return sorted(conn.execute("SELECT task_id, map_index, length, keys FROM task_map WHERE dag_id = ? "
                                   "AND run_id = ?", (dag_id, run_id)).fetchall())


def _outcome(api: httpx.Client, home: Path, dag_id: str, run_id: str, marks: Path) -> dict:
    """What a DAG author can observe of a run, keyed the same way for both DAGs."""
    db = home / "airflow.db"
    tis = sorted(_tis(api, dag_id, run_id), key=lambda ti: (ti["task_id"], ti["map_index"]))
    steps = {"shards", "pair", "echo", "group.double", "flip"}
    return {
        "states": {(ti["task_id"], ti["map_index"]): (ti["state"], ti["try_number"]) for ti in tis},
        "xcoms": {(ti["task_id"], ti["map_index"]): _xcom(api, home, dag_id, run_id, ti["task_id"], "return_value",
                                                           ti["map_index"]) for ti in tis},
        "pair_keys": [_xcom(api, home, dag_id, run_id, "pair", key, -1) for key in ("a", "b")],
        "task_maps": _task_maps(db, dag_id, run_id),
        "callbacks": sorted(p.name.split(".", 1)[1] for p in marks.glob(f"{dag_id}.*")),
        "host_lines": {(ti["task_id"], ti["map_index"]): _host_lines(api, dag_id, run_id, ti)
                       for ti in tis if ti["task_id"] in steps},
    }


def test_default_and_blocking_steps_end_the_same(airflow, api, cluster, tmp_path):
    home = Path(airflow.home)
    marks, marker = tmp_path / "marks", tmp_path / "flip-fails"
    marks.mkdir()
    conf = {"marks": str(marks), "marker": str(marker), "c": "from-conf"}
    runs = {f"tp_{mode}": f"tp-{mode}-{time.time_ns()}" for mode in MODES}
    for dag_id, run_id in runs.items():
        api.post(f"/dags/{dag_id}/dagRuns", json={"dag_run_id": run_id, "logical_date": None,
                                                  "conf": conf}).raise_for_status()
    _wait_ended(api, runs, 900)
    first = {dag_id: _outcome(api, home, dag_id, run_id, marks) for dag_id, run_id in runs.items()}
    trigger = first["tp_trigger"]
    # What the DAG's authors expect (the worker path's answer, spelled out), then the same both ways.
    assert trigger["states"][("total", -1)] == ("success", 1), trigger["states"]
    assert trigger["xcoms"][("total", -1)] == [4, 9]
    assert [trigger["xcoms"][("add", i)] for i in (0, 1)] == [12, 13]
    assert trigger["xcoms"][("read_pair", -1)] == [1, "two"] and trigger["pair_keys"] == [1, "two"]
    assert [trigger["xcoms"][("item", i)] for i in (0, 1)] == [["a", 1], ["b", "two"]]
    text, block = "{{ 6 * 7 }} and {{ ds }}", "{% for i in range(2) %}x{% endfor %}"
    assert [trigger["xcoms"][("echo", i)] for i in (0, 1)] == [[text, "2-from-conf"], [block, "2-from-conf"]]
    assert trigger["xcoms"][("flip", -1)] == [[text, block], "flipped"]
    assert trigger["xcoms"][("total_doubles", -1)] == [2, 4]
    assert ("shards", -1, 2, "null") in trigger["task_maps"] and ("pair", -1, 2, "null") in trigger["task_maps"]
    assert first["tp_trigger"] == first["tp_worker"], _differences(first)

    # A succeeded step cleared, whose next tries fail: `all_done` reads no result of the old try.
    marker.touch()
    for dag_id, run_id in runs.items():
        api.post(f"/dags/{dag_id}/clearTaskInstances", json={
            "dry_run": False, "dag_run_id": run_id, "task_ids": ["flip"], "include_downstream": True,
            "only_failed": False, "reset_dag_runs": True}).raise_for_status()
    wait_until(lambda: all(_state(api, d, r) not in ("success", "failed") for d, r in runs.items()), timeout=60,
               interval=1)
    _wait_ended(api, runs, 600)
    second = {dag_id: _outcome(api, home, dag_id, run_id, marks) for dag_id, run_id in runs.items()}
    trigger = second["tp_trigger"]
    assert trigger["states"][("flip", -1)][0] == "failed", trigger["states"]
    assert trigger["xcoms"][("after_all_done", -1)] == [None]
    assert trigger["states"][("after_none_failed", -1)][0] == "upstream_failed"
    assert second["tp_trigger"] == second["tp_worker"], _differences(second)


def _differences(outcomes: dict[str, dict]) -> dict:
    """Where the two runs differ: {(what, key): (trigger's, worker's)}."""
    trigger, worker = outcomes["tp_trigger"], outcomes["tp_worker"]
    found = {}
    for what in trigger:
        a, b = trigger[what], worker[what]
        if isinstance(a, dict):
            found.update({(what, key): (a.get(key), b.get(key)) for key in {*a, *b} if a.get(key) != b.get(key)})
        elif a != b:
            found[(what, "")] = (a, b)
    return found
