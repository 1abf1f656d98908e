"""Capacity and the queue over a cluster set (rayslice/client/set_capacity.py, `rayslice capacity --conn-id <set>`,
`rayslice queue --conn-id <set>`): every member under its name, an unreachable one said in a line, and each step
once in the queue across them, however many members list it.

Cluster-free: each member is a fake Ray dashboard at the HTTP transport (tests/http_fake.py) answering the state
and Jobs APIs as Ray does; the real two-cluster test is tests/rayslice/client/test_set_capacity_pair.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rayslice.client import capacity, set_capacity
from rayslice.client.queue import format_set_queue, join_queues
from tests.http_fake import JsonHttpFake, Request

RAYSLICE = str(Path(sys.executable).with_name("rayslice"))
SET = "tpus"


def _state(rows: list[dict]) -> dict:
    return {"result": True, "data": {"result": {"total": len(rows), "num_after_truncation": len(rows),
                                                "num_filtered": len(rows), "result": rows}}}


def job(sid: str, job_id: str, task: str, *, member: str = "", status: str = "RUNNING", start_s: float = 1_000) -> dict:
    meta = {"rayslice": "1", "dag_id": "d", "run_id": "r", "task_id": task, "request": "v6e-4", "priority": "0"}
    if member:
        meta |= {"cluster_set": SET, "cluster": member}
    return {"type": "SUBMISSION", "job_id": job_id, "submission_id": sid, "status": status,
            "start_time": int(start_s * 1000), "metadata": meta}


def queued(sid: str, job_id: str) -> dict:
    """The marker a launcher holds while it waits in its cluster's queue (`rayslice:<sid>/queued`)."""
    return {"placement_group_id": f"pg-q-{sid}", "name": f"rayslice:{sid}/queued", "state": "CREATED",
            "creator_job_id": job_id, "bundles": [{"unit_resources": {"CPU": 0.001}, "node_id": "head"}]}


def holding(sid: str, job_id: str, node: str) -> dict:
    """The head placement group of a step that holds the v6e-4 slice."""
    return {"placement_group_id": f"pg-h-{sid}", "name": f"rayslice:{sid}/heads", "state": "CREATED",
            "creator_job_id": job_id,
            "bundles": [{"unit_resources": {"TPU-v6e-4-head": 1, "TPU": 4}, "node_id": node}]}


class Dashboard(JsonHttpFake):
    """A member cluster: one v6e-4 host, the placement groups given, the jobs given (by submission id)."""

    def __init__(self, name: str, groups: list[dict], jobs: list[dict]) -> None:
        self.name, self.groups, self.jobs = name, groups, {j["submission_id"]: j for j in jobs}
        self.node = f"{name}-host0"
        super().__init__()

    def answer(self, request: Request) -> tuple[int, object]:
        if request.path == "/api/v0/nodes":
            return 200, _state([{"node_id": self.node, "state": "ALIVE", "resources_total": {"TPU": 4.0, "CPU": 8},
                                 "labels": {capacity.SLICE_LABEL: f"v6e-4-{self.name}", capacity.WORKER_LABEL: "0",
                                            capacity.POD_TYPE_LABEL: "v6e-4", capacity.TOPOLOGY_LABEL: "2x2"}}])
        if request.path == "/api/v0/placement_groups":
            return 200, _state(self.groups)
        if request.path == "/api/v0/actors":
            return 200, _state([])
        if request.path == "/api/jobs/":
            return 200, list(self.jobs.values())
        if request.path.startswith("/api/jobs/"):
            found = self.jobs.get(request.path.removeprefix("/api/jobs/"))
            return (200, found) if found else (404, {"detail": "no such job"})
        if request.path == "/api/version":
            return 200, {"ray_version": "2.60.0", "version": "4"}
        return 404, {}


def capacity_cli(*args: str, **conns: dict) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW_CONN")}
    environ |= {"COLUMNS": "250", **{f"AIRFLOW_CONN_{k.upper()}": json.dumps(v) for k, v in conns.items()}}
    return subprocess.run([RAYSLICE, *args], env=environ, capture_output=True, text=True, timeout=120)


def test_a_step_waiting_on_both_members_is_one_row_naming_both_and_an_unreachable_member_is_a_line(tmp_path):
    """Before: `rayslice capacity --conn-id <set>` refused the set ("needs one cluster")."""
    a_jobs = [job("s-wait", "01000000", "train", member="set-a"), job("s-plain", "02000000", "other")]
    b_jobs = [job("s-wait", "05000000", "train", member="set-b")]
    with (Dashboard("a", [queued("s-wait", "01000000"), holding("s-plain", "02000000", "a-host0")], a_jobs) as a,
          Dashboard("b", [queued("s-wait", "05000000")], b_jobs) as b):
        conns = {"set_a": {"conn_type": "ray", "host": a.url}, "set_b": {"conn_type": "ray", "host": b.url},
                 "set_dead": {"conn_type": "ray", "host": "http://127.0.0.1:9"},
                 SET: {"conn_type": "ray", "extra": json.dumps({"clusters": ["set_a", "set_b", "set_dead"]})}}
        out = capacity_cli("capacity", "--conn-id", SET, **conns)
        as_json = capacity_cli("capacity", "--conn-id", SET, "--json", **conns)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "== cluster set_a ==" in text and "== cluster set_b ==" in text and "== cluster set_dead ==" in text, text
    assert "v6e-4-a" in text and "v6e-4-b" in text and "d/other (r)" in text, text  # each member's slices
    assert "cluster set_dead: unreachable (" in text and "127.0.0.1:9" in text and "Traceback" not in text, text
    assert text.count("d/train (r)") == 1, text  # one step, not two competing
    assert "waits on set_a (1st in line), set_b (1st in line)" in text, text
    data = json.loads(as_json.stdout)  # only the JSON: the retry warnings about set_dead go to stderr
    assert "127.0.0.1:9" in as_json.stderr and "retrying" in as_json.stderr
    assert [(m["name"], m["snapshot"] is not None, bool(m["error"])) for m in data["members"]] == [
        ("set_a", True, False), ("set_b", True, False), ("set_dead", False, True)]
    [row] = data["queue"]
    assert (row["demand"]["holder"]["submission_id"], row["waits_on"], row["places"], row["runs_on"]) == (
        "s-wait", ["set_a", "set_b"], {"set_a": 1, "set_b": 1}, None)


def test_a_step_running_on_one_member_stands_by_on_the_other_not_waiting_there():
    """a holds the slice for s-run; b still lists it in its queue (its launcher leaves within a second) and,
    once out, its job still runs (standing by): one row, "runs on set-a; stands by on set-b"."""
    a_jobs = [job("s-run", "01000000", "train", member="set-a")]
    for b_groups in ([queued("s-run", "05000000")], []):  # still in b's queue, then out of it (standing by)
        b_jobs = [job("s-run", "05000000", "train", member="set-b"), job("s-b", "06000000", "local")]
        with (Dashboard("a", [holding("s-run", "01000000", "a-host0")], a_jobs) as a,
              Dashboard("b", [*b_groups, queued("s-b", "06000000")], b_jobs) as b):
            sources = [set_capacity.Source("set-a", a.url), set_capacity.Source("set-b", b.url)]
            found = set_capacity.read(SET, sources)
        rows = [(r.demand.holder.task_id, r.runs_on, r.stands_by, r.waits_on) for r in found.queue]
        assert rows == [("local", None, [], ["set-b"]), ("train", "set-a", ["set-b"], [])], rows
        assert set_capacity.where(found.queue[1]) == "runs on set-a; stands by on set-b"
    # An ended standby (its job FAILED with RanElsewhereError) stands by no more.
    with (Dashboard("a", [holding("s-run", "01000000", "a-host0")], a_jobs) as a,
          Dashboard("b", [], [job("s-run", "05000000", "train", member="set-b", status="FAILED")]) as b):
        found = set_capacity.read(SET, [set_capacity.Source("set-a", a.url), set_capacity.Source("set-b", b.url)])
    assert found.queue == []


def test_the_queue_across_members_folds_one_step_by_submission_id():
    """`rayslice queue --conn-id <set>`: the brokers' entries (id `<sid>/<ns>`), one row per step."""

    def entry(sid: str, label: str, arrival: float, admitted: bool = False, priority: int = 0) -> dict:
        return {"id": f"{sid}/{int(arrival * 1e9)}", "label": label, "what": "1 x v6e-4", "priority": priority,
                "team": None, "arrival": arrival, "admitted": admitted,
                "admitted_at": arrival + 5 if admitted else None}

    settings = {"policy": "strict", "aging_s": 0, "quotas": {}}
    a = {"entries": [entry("s-run", "d.train", 100, admitted=True), entry("s-both", "d.eval", 110)],
         "settings": settings}
    b = {"entries": [entry("s-x", "d.x", 90), entry("s-both", "d.eval", 110), entry("s-run", "d.train", 100)],
         "settings": settings}
    rows = join_queues([("set-a", a), ("set-b", b), ("set-dead", None)], standing={"s-run": ["set-dead"]})
    summary = [(r["label"], r["runs_on"], r["waits_on"], r["ranks"], r["stands_by"]) for r in rows]
    assert summary == [("d.train", "set-a", [], {}, ["set-b", "set-dead"]),
                       ("d.x", None, ["set-b"], {"set-b": 1}, []),
                       ("d.eval", None, ["set-a", "set-b"], {"set-a": 1, "set-b": 2}, [])], summary
    text = format_set_queue(rows, now=200)
    assert "runs on set-a; stands by on set-b, set-dead" in text and "waits on set-a (rank 1), set-b (rank 2)" in text
    assert text.count("d.train") == 1 and text.count("d.eval") == 1, text


def test_a_set_member_whose_connection_is_missing_is_a_line_and_the_others_are_shown():
    with Dashboard("a", [], []) as a:
        conns = {"set_a": {"conn_type": "ray", "host": a.url},
                 SET: {"conn_type": "ray", "extra": json.dumps({"clusters": ["set_a", "set_gone"]})}}
        out = capacity_cli("capacity", "--conn-id", SET, **conns)
        queue = capacity_cli("queue", "--conn-id", SET, "--set", '{"policy": "strict"}', **conns)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "cluster set_gone: unreachable (its connection:" in text, text
    assert "v6e-4-a" in text and f"Nothing waits on set {SET}" in text, text
    assert queue.returncode == 1 and "each cluster's queue policy is its own" in queue.stdout, queue.stdout
