"""Following a job's log as a stream (the dashboard's log-tail websocket), against the real local cluster.

Every line relayed exactly once and in order, from a follow that starts while the job is pending,
across a stream cut by a proxy, and for about the log's own size in streamed bytes.
"""

from __future__ import annotations

import asyncio
import shlex
import uuid

import pytest

from rayslice.client.jobs_client import AsyncRayJobsClient, JobStatus
from rayslice.client.submission import JobFollow, LogFollower, wait_for_step
from tests.faults.proxy import FaultProxy

LINES = 300


def chatty_job(lines: int = LINES, pause: float = 0.015) -> str:
    """An entrypoint that prints `lines` numbered lines over a few seconds, then a rayslice result line."""
    script = (
        "import time\n"
        f"for i in range({lines}):\n"
        "    print(f'payload-{i:04d} ' + 'x' * 40, flush=True)\n"
        f"    time.sleep({pause})\n"
        "print('::rayslice-' + 'result::42', flush=True)\n"  # split: the entrypoint echo must not hold a marker
    )
    return f"python -c {shlex.quote(script)}"


def expected(lines: int = LINES) -> list[str]:
    return [f"payload-{i:04d} " + "x" * 40 for i in range(lines)]


def payload(relayed: list[str]) -> list[str]:
    return [line for line in relayed if line.startswith("payload-")]


async def submit(client: AsyncRayJobsClient, tag: str, **kwargs) -> str:
    return await client.submit(chatty_job(**kwargs), submission_id=f"rsls-{tag}-{uuid.uuid4().hex[:8]}")


# ---------------------------------------------------------------- LogFollower alone


def test_follower_relays_whole_lines_once_across_chunks_and_restarts():
    relayed: list[str] = []
    lines = LogFollower(relayed.append)
    log = "a1\n\x1b[32mb2\x1b[0m\nc3\n::rayslice-result::7\nd4"
    lines.chunk(log[:4])  # "a1\nb" cut inside a line
    assert relayed == ["a1"] and lines.offset == 3
    lines.restart()  # a new stream re-sends from the start
    lines.chunk(log[:10])
    lines.chunk(log[10:20])
    lines.restart()
    lines.chunk(log)
    lines.flush()  # the log ended without a newline
    assert relayed == ["a1", "b2", "c3", "d4"]  # ANSI codes stripped, the marker kept back
    assert lines.offset == len(log) and lines.markers == "::rayslice-result::7"
    again: list[str] = []
    LogFollower(again.append, offset=len("a1\n\x1b[32mb2\x1b[0m\n")).feed(log)
    assert again == ["c3"]  # from an offset (a restarted trigger): nothing before it, the tail kept back


# ---------------------------------------------------------------- against the cluster


@pytest.fixture
async def jobs(cluster):
    async with AsyncRayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
        yield client


async def test_wait_for_step_relays_every_line_once_for_about_the_log_size(cluster, jobs):
    sid = await submit(jobs, "wait")
    relayed: list[str] = []
    async with AsyncRayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
        assert await asyncio.wait_for(wait_for_step(client, sid, emit=relayed.append, poll=0.5), 120) == 42
        streamed = client.bytes_streamed
    assert payload(relayed) == expected()
    size = len((await jobs.logs(sid)).encode())
    print(f"\n[log stream] log {size} bytes, streamed {streamed} bytes")
    assert size > LINES * 50 and streamed <= 1.2 * size, (streamed, size)


async def test_a_follow_started_while_the_job_is_pending_gets_every_line(jobs):
    sid = await submit(jobs, "pending")
    relayed: list[str] = []
    follow = JobFollow(jobs, sid, LogFollower(relayed.append), poll=0.3)
    seen = [job.status async for job in follow.statuses()]
    assert seen[0] == JobStatus.PENDING, seen  # Ray's runtime-env setup keeps a fresh job pending for seconds
    assert seen[-1] == JobStatus.SUCCEEDED and follow.outcome() == 42
    assert payload(relayed) == expected()


async def test_a_cut_stream_reconnects_and_loses_no_line(cluster, jobs):
    sid = await submit(jobs, "cut", lines=400, pause=0.02)
    proxy = FaultProxy(cluster.dashboard_url).up()
    relayed: list[str] = []
    warnings: list[str] = []
    try:
        async with AsyncRayJobsClient(proxy.url, token=cluster.token) as client:
            follow = JobFollow(client, sid, LogFollower(relayed.append), poll=0.3, warn=warnings.append)
            following = asyncio.ensure_future(_drain(follow))
            for _ in range(600):
                if len(payload(relayed)) >= 50 or following.done():
                    break
                await asyncio.sleep(0.05)
            assert len(payload(relayed)) >= 50 and not following.done(), "the job ended before the cut"
            proxy.down()  # cuts the open websocket and refuses new connections
            await asyncio.sleep(1.5)
            proxy.up()
            await asyncio.wait_for(following, 120)
    finally:
        proxy.down()
    assert payload(relayed) == expected(400)
    assert follow.streams >= 2 and follow.outcome() == 42, follow.streams
    assert any("log stream" in w for w in warnings), warnings


async def _drain(follow: JobFollow) -> None:
    async for _ in follow.statuses():
        pass
