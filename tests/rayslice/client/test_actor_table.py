"""`rayslice.client.actor_table`: the usage timeline reads the actor table in a child process.

The cut-down table must bill and draw exactly what the whole one does (same bars, same hours, the
same "oldest"), and the child's errors must reach the page as the Jobs client's own, secrets
scrubbed. That the cut keeps the API server's event loop free is measured in bench/slices_page.py.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from rayslice.client import actor_table, usage
from rayslice.core.exceptions import RayAuthError, RaysliceError
from tests.http_fake import JsonHttpFake, Request
from tests.rayslice.client.test_usage import NOW, H, _actor, _job, _nodes

ACTORS = [
    *(_actor(f"rayslice:s1/v6e-16-a/host{w}", NOW - H, None, {"TPU": 4, "CPU": 1}) for w in range(4)),
    _actor("rayslice:s2/GPU", NOW - 3 * H, NOW - 2 * H, {"GPU": 0.25}, node="g1"),
    _actor("rayslice:s3/GPU", NOW - 30 * H, NOW - 29 * H, {"GPU": 0.5}, node="g1"),  # before the window
    _actor("rayslice:s4/GPU", NOW - 20 * H, NOW - 19 * H, {"GPU": 1}, node="g1"),  # before it, later
    _actor("rayslice:s5/GPU", 0, None, {"GPU": 1}, node="g1"),  # never started
    _actor("someone-else", NOW - H, None, {"GPU": 1}, node="g1"),
]
JOBS = [_job("s1", "train", NOW - H - 5, "RUNNING"), _job("s2", "eval", NOW - 3 * H)]


def _body(actors: list[dict]) -> dict:
    return {"data": {"actors": {f"a{i}": {**a, "className": "HostProcess", "pid": 7, "extra": "x" * 50}
                                for i, a in enumerate(actors)}}}


def test_the_window_keeps_what_the_timeline_counts_and_little_else():
    whole = _body(ACTORS)
    cut = actor_table.window(whole, now=NOW, hours=6)
    assert usage.parse(_nodes(), cut, JOBS, now=NOW, hours=6) == usage.parse(_nodes(), whole, JOBS, now=NOW, hours=6)
    assert usage.step_ids(cut, now=NOW, hours=6) == usage.step_ids(whole, now=NOW, hours=6) == {"s1", "s2"}
    kept = cut["data"]["actors"]
    assert sorted(a["name"] for a in kept.values()) == sorted(  # s3: the oldest start, for "Ray remembers since"
        [*(f"rayslice:s1/v6e-16-a/host{w}" for w in range(4)), "rayslice:s2/GPU", "rayslice:s3/GPU"])
    assert all("extra" not in a and "pid" not in a for a in kept.values())


class _Dashboard(JsonHttpFake):
    def __init__(self, token: str | None = None) -> None:
        super().__init__()
        self.token, self.actor_reads = token, 0

    def answer(self, request: Request) -> tuple[int, object]:
        if self.token and request.authorization != f"Bearer {self.token}":
            return 401, {"error": "unauthorized"}
        if request.path == "/logical/actors":
            self.actor_reads += 1
            return 200, _body(ACTORS)
        if request.path == "/api/v0/nodes":
            return 200, _nodes()
        if request.path.startswith("/api/jobs/"):
            sid = request.path.rstrip("/").rsplit("/", 1)[-1]
            found = [j for j in JOBS if j["submission_id"] == sid]
            return (200, found[0]) if found else (404, {"error": "not found"})
        return 404, {}


def test_the_page_reading_equals_the_blocking_one(monkeypatch):
    monkeypatch.setattr(usage.time, "time", lambda: NOW)
    with _Dashboard(token="s3cret") as dashboard:
        found = asyncio.run(usage.ausage(dashboard.url, token="s3cret", hours=6))
        assert dashboard.actor_reads == 1
        assert found == usage.usage(dashboard.url, token="s3cret", hours=6)
    assert [(b.submission_id, b.task_id) for b in found.bars] == [("s2", "eval"), ("s1", "train")]
    assert found.oldest is not None and found.oldest.timestamp() == NOW - 30 * H


def test_the_childs_errors_are_the_clients_own_with_secrets_scrubbed():
    with _Dashboard(token="right") as dashboard:
        with pytest.raises(RayAuthError) as caught:
            asyncio.run(actor_table.aread_window(dashboard_url=dashboard.url, token="wr0ng-t0ken", timeout=5,
                                                 verify=True, headers={"X-Proxy-Key": "hdr-s3cret"}, now=NOW,
                                                 hours=6))
    assert "wr0ng-t0ken" not in str(caught.value) and "hdr-s3cret" not in str(caught.value)


def _child_runs(monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    """The reader's child runs `script` instead (same pipes, same handling)."""
    real_exec = asyncio.create_subprocess_exec

    async def instead(program, *args, **kwargs):
        return await real_exec(program, "-c", script, **kwargs)

    monkeypatch.setattr(actor_table.asyncio, "create_subprocess_exec", instead)


def _read() -> object:
    return actor_table.aread_window(dashboard_url="http://127.0.0.1:9", token=None, timeout=5, verify=True,
                                    headers=None, now=NOW, hours=6)


def test_a_reader_cancelled_leaves_no_child(monkeypatch, tmp_path):
    """The page's request goes away while the child reads: the child is killed, not left running."""
    started = tmp_path / "pid"
    _child_runs(monkeypatch, f"import os, time; open({str(started)!r}, 'w').write(str(os.getpid())); time.sleep(60)")

    async def main() -> None:
        reading = asyncio.ensure_future(_read())
        while not started.exists() or not started.read_text():
            await asyncio.sleep(0.02)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        with pytest.raises(ProcessLookupError):  # gone (and reaped) by the time the cancelled reader returns
            os.kill(int(started.read_text()), 0)

    asyncio.run(main())


def test_a_child_that_crashes_says_so_with_its_last_words(monkeypatch):
    _child_runs(monkeypatch, "import sys; print('MemoryError: out of memory', file=sys.stderr); sys.exit(3)")
    with pytest.raises(RaysliceError, match=r"exit code 3\): MemoryError: out of memory"):
        asyncio.run(_read())
