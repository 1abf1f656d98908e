"""One step over two clusters through the session's real Airflow, drained in the middle (issue 53).

A platform team's connections, made through Airflow's REST API: `pair_a` and `pair_b`, one per real
local cluster (tests/cluster_pair.py), and `pair_set`, the set of both with a checkpoint root both
read. `set_train.train` (tests/e2e/dags/cluster_set_drain.py) is triggered through the REST API as a
user would; whichever cluster runs it is drained with a 30 s deadline once it has saved a step.

Must hold (issue 53, "Failover on a notice"): the step resumes on the other cluster from its checkpoint,
no step is done twice, one Airflow try succeeds, and the drained cluster's chips are free before the
deadline. Proof comes from outside the launcher: the run and task instance from Airflow's REST API,
the bodies' own records, both clusters' job records and state APIs.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
from rayslice.operators.links import CLUSTER_KEY

from rayslice.local import local_cluster
from tests.cluster_pair import NAMES
from tests.conftest import wait_until
from tests.e2e.conftest import add_dags, xcom

pytestmark = pytest.mark.timeout(900)

DAGS = Path(__file__).parent / "dags" / "cluster_set_drain.py"
DAG_ID, TASK_ID = "set_train", "train"
CONN = {"set-a": "pair_a", "set-b": "pair_b"}  # each local cluster's member connection
STEPS, DEADLINE_S = 12, 30


def _connections(api, pair) -> None:
    for name, conn_id in CONN.items():
        record = pair.records[name]
        api.delete(f"/connections/{conn_id}")
        api.post("/connections", json={"connection_id": conn_id, "conn_type": "ray", "host": record.dashboard_url,
                                       "password": record.token, "extra": json.dumps({"launcher": "installed"})}
                 ).raise_for_status()
    api.delete("/connections/pair_set")
    api.post("/connections", json={"connection_id": "pair_set", "conn_type": "ray", "extra": json.dumps({
        "clusters": list(CONN.values()), "checkpoint_root": f"file://{pair.shared}", "shared_root": True})}
             ).raise_for_status()


def test_a_drain_on_the_cluster_running_a_set_step_resumes_it_on_the_other_in_one_airflow_try(
        airflow, airflow_api, cluster_pair):
    api, pair = airflow_api, cluster_pair
    _connections(api, pair)
    add_dags(airflow, api, DAGS, [DAG_ID])
    run_id = f"set-train-{time.time_ns()}"
    found: list[Path] = []

    def folder() -> Path | None:
        """The task's checkpoint folder, once it has one (under the deployment's own folder of the root)."""
        found.extend([] if found else pair.shared.glob(f"*/{DAG_ID}/{run_id}/{TASK_ID}"))
        return found[0] if found else None
    by_gcs = {pair.records[n].gcs_address: n for n in NAMES}
    drained: dict = {}

    def drain_the_running_one_once_it_saved() -> None:
        if not wait_until(lambda: folder() and (folder() / "step.json").exists(), timeout=600, interval=0.5):
            return
        first = json.loads((folder() / "bodies.jsonl").read_text().splitlines()[0])["gcs"]
        record = pair.records[drained.setdefault("name", by_gcs[first])]
        drained["deadline"] = time.time() + DEADLINE_S
        local_cluster.preempt(record, next(n.slice_name for n in record.nodes if n.slice_name), DEADLINE_S,
                              kill=False)
        drained["free"] = wait_until(lambda: not pair.held_by(record.name, drained["sid"]), timeout=DEADLINE_S,
                                     interval=0.5)
        drained["free_at"] = time.time()

    drainer = threading.Thread(target=drain_the_running_one_once_it_saved, daemon=True)
    api.post(f"/dags/{DAG_ID}/dagRuns", json={"dag_run_id": run_id, "logical_date": None,
                                              "conf": {"steps": STEPS, "seconds_per_step": 1.0}}).raise_for_status()
    try:
        ti_url = f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{TASK_ID}"
        drained["sid"] = wait_until(lambda: xcom(api, ti_url, "ray_submission_id"), timeout=600, interval=0.5)
        assert drained["sid"], api.get(ti_url).json()
        drainer.start()
        state = lambda: api.get(f"/dags/{DAG_ID}/dagRuns/{run_id}").json()["state"]  # noqa: E731
        assert wait_until(lambda: state() in ("success", "failed"), timeout=600, interval=1), state()
    finally:
        drainer.join(120)
        if "name" in drained:
            pair.replace_tpu_node(drained["name"])  # a drained node is done: the next tests get a fresh one
    ti = api.get(ti_url).json()
    log = api.get(f"{ti_url}/logs/{ti['try_number']}", params={"full_content": True}).text
    assert state() == "success" and ti["try_number"] == 1, (ti, log[-4000:])

    assert "name" in drained, f"the drain never found the step's saved step in {pair.shared}: {log[-3000:]}"
    drained_name = drained["name"]
    other = next(n for n in NAMES if n != drained_name)
    result = xcom(api, ti_url)[0]  # the slice's one host's result
    assert by_gcs[result["gcs"]] == other and result["resumed_from"] > 0, result
    bodies = [json.loads(line) for line in (folder() / "bodies.jsonl").read_text().splitlines()]
    assert [by_gcs[body["gcs"]] for body in bodies] == [drained_name, other], bodies
    done = [json.loads(line)["step"] for line in (folder() / "done.jsonl").read_text().splitlines()]
    assert done == list(range(STEPS)), f"a step was done twice or skipped: {done}"
    assert drained["free"] and drained["free_at"] < drained["deadline"], pair.held_by(drained_name, drained["sid"])
    # Both clusters' own job records: the other ran it to success; the drained one stood by once it was claimed.
    status, other_log = pair.jobs(other, drained["sid"])
    assert status == "SUCCEEDED", other_log[-2000:]
    status, drained_log = pair.jobs(drained_name, drained["sid"])
    assert status == "FAILED" and "RanElsewhereError" in drained_log, drained_log[-2000:]
    assert f"the step ran on cluster {CONN[other]}" in log and "released claim 0" in log, log[-4000:]
    # The task told where the step runs as it moved: its log, in order, then its XCom (which the "Ray job" link reads).
    told = re.findall(r"\[rayslice\] (the step runs on|the step moved to) cluster (\w+):", log)
    assert told == [("the step runs on", CONN[drained_name]), ("the step moved to", CONN[other])], told
    assert xcom(api, ti_url, CLUSTER_KEY) == {"submission_id": drained["sid"], "cluster": CONN[other]}
    assert not pair.held_by(other, drained["sid"]), pair.held_by(other, drained["sid"])
