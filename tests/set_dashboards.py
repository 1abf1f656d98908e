"""Two fake Ray dashboards, the members `set_a` and `set_b` of a cluster set, with the records a step over both leaves.

`s1` ran on set_b; set_a's job of it stood by (FAILED with RanElsewhereError, no host process, no goodput record).
`s2` ran its first attempt on set_a, was suspended there, and resumed on set_b: an attempt on each, and set_a's
job then stood by. Served over real HTTP (tests/http_fake.py), as each member's Jobs and state APIs answer.
"""

from __future__ import annotations

import time
from typing import Any

from rayslice.core import goodput
from tests.http_fake import JsonHttpFake, Request, Text

H = 3600.0
STOOD_BY = ("Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):\n"
            '::rayslice-error::t0::{"type": "RanElsewhereError", "message": "cluster set_b of set \'tpus\' ran this '
            'step (succeeded); cluster set_a stood by and ends without running it"}\n')


def _actor(sid: str, start: float, end: float) -> dict:
    return {"name": f"rayslice:{sid}/v6e-4-a/host0", "state": "DEAD", "startTime": int(start * 1000),
            "endTime": int(end * 1000), "requiredResources": {"TPU": 4, "CPU": 1}, "address": {"nodeId": "t1"}}


def _job(sid: str, task: str, status: str, start: float, end: float, message: str = "") -> dict:
    return {"submission_id": sid, "job_id": f"0{len(sid)}000000", "status": status, "start_time": int(start * 1000),
            "end_time": int(end * 1000), "message": message, "driver_node_id": "head", "type": "SUBMISSION",
            "metadata": {"rayslice": "1", "dag_id": "d", "run_id": "r", "task_id": task, "request": "v6e-4",
                         "map_index": "-1", "try_number": "1"}}


def _held(reserved: float, released: float, outcome: str) -> dict:
    return {"queued": reserved - 5, "reserved": reserved, "hosts_started": reserved + 5, "step_started": reserved + 10,
            "released": released, "chips": 4, "outcome": outcome,
            "detail": {"actors_started": reserved + 5, "gang_returned": released - 1}}


class Dashboard(JsonHttpFake):
    """One member's dashboard: nodes, the actor table, job records by id, and each job's log."""

    def __init__(self, jobs: list[dict], actors: list[dict], logs: dict[str, str]) -> None:
        super().__init__()
        self.jobs = {j["submission_id"]: j for j in jobs}
        self.actors, self.logs = actors, logs

    def answer(self, request: Request) -> tuple[int, Any]:
        if request.path == "/api/v0/nodes":
            node = {"node_id": "t1", "state": "ALIVE", "resources_total": {"TPU": 4},
                    "labels": {"ray.io/tpu-slice-name": "v6e-4-a", "ray.io/tpu-pod-type": "v6e-4"}}
            return 200, {"data": {"result": {"result": [node]}}}
        if request.path == "/logical/actors":
            return 200, {"data": {"actors": {str(i): a for i, a in enumerate(self.actors)}}}
        if request.path == "/api/v0/logs/file":
            sid = request.query["filename"][0].removeprefix("job-driver-").removesuffix(".log")
            return 200, Text(self.logs.get(sid, ""))
        if request.path == "/api/jobs/":
            return 200, list(self.jobs.values())
        if request.path.startswith("/api/jobs/"):
            job = self.jobs.get(request.path.removeprefix("/api/jobs/"))
            return (200, job) if job else (404, {"detail": "not found"})
        if request.path == "/api/version":
            return 200, {"ray_version": "2.60.0", "version": "4"}
        return 404, {"detail": request.path}


def pair(now: float | None = None) -> tuple[Dashboard, Dashboard, dict[str, goodput.Account]]:
    """(set_a, set_b, each step's account on each member `"<sid>@<member>"`): the records described above."""
    now = time.time() if now is None else now
    s1_b = goodput.step_account([_held(now - 2 * H, now - H, "succeeded")])
    s2_a = goodput.step_account([_held(now - 5 * H, now - 4 * H, "preempted")])
    s2_b = goodput.step_account([_held(now - 4 * H + 60, now - 3 * H, "succeeded")])
    a = Dashboard(
        jobs=[_job("s1", "t1", "FAILED", now - 2 * H - 10, now - H + 2, STOOD_BY),
              _job("s2", "t2", "FAILED", now - 5 * H - 10, now - 3 * H + 2, STOOD_BY)],
        actors=[_actor("s2", now - 5 * H + 5, now - 4 * H - 1)],
        logs={"s1": STOOD_BY, "s2": goodput.record_line(s2_a) + "\n" + STOOD_BY})
    b = Dashboard(
        jobs=[_job("s1", "t1", "SUCCEEDED", now - 2 * H - 10, now - H + 1),
              _job("s2", "t2", "SUCCEEDED", now - 5 * H - 10, now - 3 * H + 1)],
        actors=[_actor("s1", now - 2 * H + 5, now - H - 1), _actor("s2", now - 4 * H + 65, now - 3 * H - 1)],
        logs={"s1": goodput.record_line(s1_b) + "\n::rayslice-result::t0::[1]",
              "s2": goodput.record_line(s2_b) + "\n::rayslice-result::t0::[1]"})
    return a, b, {"s1@set_b": s1_b, "s2@set_a": s2_a, "s2@set_b": s2_b}
