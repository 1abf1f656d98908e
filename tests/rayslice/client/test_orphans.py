"""`rayslice reap --dry-run` against a fake Ray dashboard: it only reads, and names what the sweep would remove.

The real sweep's rule (a `rayslice:` name whose creating Ray job has ended) on a real cluster, and that a
dry run there submits no job: tests/rayslice/cluster/test_reaper.py.
"""

from __future__ import annotations

import asyncio

from rayslice.client import orphans
from tests.http_fake import JsonHttpFake, Request


def _state(rows: list[dict]) -> dict:
    return {"result": True, "msg": "", "data": {"result": {"total": len(rows), "num_after_truncation": len(rows),
                                                          "num_filtered": len(rows), "result": rows}}}


class FakeDashboard(JsonHttpFake):
    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Request] = []
        self.jobs = [
            {"type": "SUBMISSION", "submission_id": "ended-step", "job_id": "02000000", "status": "FAILED"},
            {"type": "SUBMISSION", "submission_id": "live-step", "job_id": "03000000", "status": "RUNNING"},
            {"type": "DRIVER", "submission_id": None, "job_id": "04000000", "status": "SUCCEEDED"},
        ]
        self.groups = [
            {"name": "rayslice:ended-step/heads", "creator_job_id": "02000000", "state": "CREATED"},
            {"name": "rayslice:live-step/heads", "creator_job_id": "03000000", "state": "CREATED"},
            # named after an ended job, made by a live one (a spec.json run again by hand): stays
            {"name": "rayslice:ended-step/hosts", "creator_job_id": "03000000", "state": "CREATED"},
            {"name": "someone-elses", "creator_job_id": "02000000", "state": "CREATED"},
            {"name": "rayslice:by-hand/heads", "creator_job_id": "04000000", "state": "CREATED"},
        ]
        self.actors = [
            {"name": "rayslice:ended-step/v6e-4-a/host0", "job_id": "02000000", "state": "ALIVE"},
            {"name": "rayslice:live-step/v6e-4-a/host0", "job_id": "03000000", "state": "ALIVE"},
            {"name": "rayslice:unknown-job/x", "job_id": "09000000", "state": "ALIVE"},  # creator not listed
        ]

    def answer(self, request: Request):
        self.requests.append(request)
        if request.method != "GET":
            return 405, {"error": f"{request.method} {request.path}"}
        if request.path == "/api/jobs/":
            return 200, self.jobs
        if request.path == "/api/v0/placement_groups":
            return 200, _state(self.groups)
        if request.path == "/api/v0/actors":
            return 200, _state(self.actors)
        return 404, {"error": request.path}


def test_a_dry_run_only_reads_and_names_the_leftovers_of_ended_jobs():
    lines: list[str] = []
    with FakeDashboard() as fake:
        report = asyncio.run(orphans.reap(fake.url, dry_run=True, emit=lines.append))
    assert {r.method for r in fake.requests} == {"GET"}  # no job submitted, no package uploaded, nothing stopped
    assert not any("package" in r.path or r.path.startswith("/api/jobs/") and r.path != "/api/jobs/"
                   for r in fake.requests), [r.path for r in fake.requests]
    assert report.stopped == []
    assert sorted((o["kind"], o["name"], o["job_status"]) for o in report.reaped) == [
        ("actor", "rayslice:ended-step/v6e-4-a/host0", "FAILED"),
        ("placement_group", "rayslice:by-hand/heads", "ended (its driver exited)"),
        ("placement_group", "rayslice:ended-step/heads", "FAILED"),
    ]
    assert "would reap placement_group rayslice:ended-step/heads (its Ray job is FAILED)" in lines
