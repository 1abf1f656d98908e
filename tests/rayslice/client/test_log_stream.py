"""Following a job's log as a stream (the dashboard's log-tail websocket), against the real local cluster.

Every line relayed exactly once and in order, from a follow that starts while the job is pending,
across a stream cut by a proxy, and for about the log's own size in streamed bytes; behind a proxy
that does not pass websockets (bounded reads of the log's end instead), after a stream that lags,
and for a line longer than a stream message may be.
"""

from __future__ import annotations

import asyncio
import shlex
import uuid

import pytest

from rayslice.client import jobs_client
from rayslice.client.jobs_client import AsyncRayJobsClient, JobStatus
from rayslice.client.submission import JobFollow, LogFollower, wait_for_step
from tests.faults.http_proxy import NoWebsocketProxy
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

GLOO = "[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
SIMULATED_HOSTS_LOG = (
    "[rayslice] running on v6e-16-a: 4 hosts x 4 chips\n"
    f"(v6e-16-a/host1 pid=2101) {GLOO}\n"
    f"\x1b[36m(v6e-16-a/host2 pid=2102, ip=10.0.0.7)\x1b[0m {GLOO.replace('Rank 1', 'Rank 2')}\n"
    "(v6e-16-a/host3 pid=2103) [Gloo] Rank 3 is connected to 3 peer ranks.\n"
    "(v6e-16-a/host1 pid=2101) step 1 loss 0.5\n"
    "(v6e-16-a/host1 pid=2101) [Gloo] Rank 1: Connection reset by peer\n"
    f"{GLOO}\n"
    f"(v6e-16-a/host0 pid=2100) my program says: {GLOO}\n"
)


@pytest.mark.parametrize("env", [None, "0"])
def test_the_simulated_slices_gloo_connection_lines_stay_out_of_the_task_log(monkeypatch, env):
    """One such line per host and JAX group: hidden; every other host line, gloo's errors too, is relayed."""
    if env is None:
        monkeypatch.delenv("RAYSLICE_SHOW_GLOO_CONNECTS", raising=False)
    else:
        monkeypatch.setenv("RAYSLICE_SHOW_GLOO_CONNECTS", env)
    relayed: list[str] = []
    LogFollower(relayed.append).feed(SIMULATED_HOSTS_LOG)
    assert relayed == ["[rayslice] running on v6e-16-a: 4 hosts x 4 chips",
                       "(v6e-16-a/host1 pid=2101) step 1 loss 0.5",
                       "(v6e-16-a/host1 pid=2101) [Gloo] Rank 1: Connection reset by peer",
                       GLOO,  # not from a host: some other program's print, relayed as it is
                       f"(v6e-16-a/host0 pid=2100) my program says: {GLOO}"]


def test_two_gloo_connection_lines_written_into_each_other_stay_out_too(monkeypatch):
    """A host joining two JAX groups at once: gloo's two threads interleave their writes (seen in the demo).
    The pieces are hidden; a host line with any word of its own is relayed."""
    monkeypatch.delenv("RAYSLICE_SHOW_GLOO_CONNECTS", raising=False)
    interleaved = (
        "(v6e-16-b/host3 pid=1528) [Gloo] Rank [Gloo] Rank 7 is connected to 7 peer ranks. Expected number of "
        "connected peer ranks is : 7\n"
        "(v6e-16-b/host3 pid=1528) 7 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n"
        "(v6e-16-b/host3 pid=2152) [Gloo] Rank 3 is connected to 3[Gloo] Rank 3 is connected to 3 peer ranks. "
        "Expected number of connected peer ranks is : 3\n"
        "(v6e-16-b/host3 pid=2152)  peer ranks. Expected number of connected peer ranks is : 3\n"
        "(v6e-16-b/host3 pid=2152) Rank 3 is connected to my database\n"
        "(v6e-16-b/host3 pid=2152) 7 peers connected\n"
    )
    relayed: list[str] = []
    LogFollower(relayed.append).feed(interleaved)
    assert relayed == ["(v6e-16-b/host3 pid=2152) Rank 3 is connected to my database",
                       "(v6e-16-b/host3 pid=2152) 7 peers connected"]


def test_the_gloo_connection_lines_show_when_asked(monkeypatch):
    every = [line.replace("\x1b[36m", "").replace("\x1b[0m", "") for line in SIMULATED_HOSTS_LOG.splitlines()]
    monkeypatch.setenv("RAYSLICE_SHOW_GLOO_CONNECTS", "1")
    relayed: list[str] = []
    LogFollower(relayed.append).feed(SIMULATED_HOSTS_LOG)
    assert relayed == every
    monkeypatch.delenv("RAYSLICE_SHOW_GLOO_CONNECTS")
    relayed.clear()
    LogFollower(relayed.append, show_gloo_connects=True).feed(SIMULATED_HOSTS_LOG)
    assert relayed == every




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


def test_windows_of_the_logs_end_relay_each_line_once_and_say_when_lines_are_missing():
    log = "".join(f"line {i}\n" for i in range(10))
    relayed: list[str] = []
    lines = LogFollower(relayed.append)
    assert lines.window(log[: log.index("line 4")], asked=10)  # fewer lines than asked: the whole log so far
    assert lines.window(log[log.index("line 2"):], asked=8)  # overlaps what was relayed: placed by it
    assert relayed == [f"line {i}" for i in range(10)] and lines.offset == len(log)
    assert lines.window(log[log.index("line 7"):] + "line 10\nline 11", asked=5, ended=True)
    assert relayed[-3:] == ["line 9", "line 10", "line 11"] and lines.offset == len(log) + len("line 10\nline 11")

    # A window that does not reach back to the last line relayed: what it holds, and False.
    gap: list[str] = []
    behind = LogFollower(gap.append)
    behind.window("line 0\nline 1\n", asked=2)
    assert not behind.window("line 6\nline 7\n", asked=2, only_if_placed=True) and gap == ["line 0", "line 1"]
    assert not behind.window("line 8\nline 9\n", asked=2) and gap == ["line 0", "line 1", "line 8", "line 9"]

    # A follower restarted from another's state relays nothing twice, from a stream or a window.
    state = LogFollower(lambda _: None)
    state.feed(log[: log.index("line 6")])
    again: list[str] = []
    LogFollower(again.append, **state.state()).window(log[log.index("line 3"):], asked=7)
    streamed: list[str] = []
    LogFollower(streamed.append, **state.state()).feed(log)
    assert again == streamed == [f"line {i}" for i in range(6, 10)]


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


# ---------------------------------------------------------------- behind a proxy that does not pass websockets


async def _follow_to_end(follow: JobFollow, timeout: float = 120) -> None:
    await asyncio.wait_for(_drain(follow), timeout)


@pytest.mark.parametrize("refusal", ["404", "hang"])
async def test_without_websockets_the_follow_polls_with_bounded_reads(cluster, jobs, refusal):
    """A proxy that answers the log tail's upgrade with 404, or never: the result and every line still arrive."""
    sid = await submit(jobs, f"nows{refusal}", pause=0.01)
    relayed: list[str] = []
    warnings: list[str] = []
    with NoWebsocketProxy(cluster.dashboard_url, websockets=refusal) as proxy:
        async with AsyncRayJobsClient(proxy.url, token=cluster.token, timeout=5) as client:
            follow = JobFollow(client, sid, LogFollower(relayed.append), poll=0.3, call_timeout=10,
                               warn=warnings.append)
            await _follow_to_end(follow)
    assert follow.outcome() == 42 and payload(relayed) == expected()
    assert follow.polling and any("unavailable" in w for w in warnings), warnings
    size = len((await jobs.logs(sid)).encode())
    read = proxy.bytes_to("/api/v0/logs/")
    print(f"\n[no websockets: {refusal}] log {size} bytes, read {read} bytes in {follow.window_reads} bounded reads")
    assert proxy.bytes_of(f"/api/jobs/{sid}/logs") == 0  # never the whole log
    # Linear in the log (each read asks 1.5 times the lines the last one found new), plus a few lines per poll.
    assert read <= 3 * size + follow.window_reads * JobFollow.MIN_WINDOW * 60, (read, size)


async def test_a_get_answered_500_is_retried(cluster, jobs):
    sid = await submit(jobs, "r500", lines=1)
    with NoWebsocketProxy(cluster.dashboard_url) as proxy:
        async with AsyncRayJobsClient(proxy.url, token=cluster.token, backoff=0.01) as client:
            proxy.fail_gets(2)
            assert (await client.get(sid)).submission_id == sid
    assert proxy.requests.count(f"GET /api/jobs/{sid}") == 3


async def test_a_lagging_stream_is_caught_up_with_a_bounded_read_not_the_whole_log(cluster, jobs):
    """The stream is still behind END_GRACE_S after the end: the rest comes from the log's last lines."""
    sid = await submit(jobs, "lag", pause=0.002)
    assert await asyncio.wait_for(_ended(jobs, sid), 120) == JobStatus.SUCCEEDED
    relayed: list[str] = []
    with NoWebsocketProxy(cluster.dashboard_url, websockets="slow", slow_s=0.1) as proxy:
        async with AsyncRayJobsClient(proxy.url, token=cluster.token) as client:
            follow = JobFollow(client, sid, LogFollower(relayed.append), poll=0.3)
            follow.END_GRACE_S = 1.0
            await _follow_to_end(follow)
    assert follow.outcome() == 42 and payload(relayed) == expected()
    assert follow.streams >= 1 and 0 < len(payload(relayed)[:10])
    assert f"GET /api/jobs/{sid}/logs" not in proxy.requests, proxy.requests
    assert follow.window_reads >= 1


async def test_a_line_longer_than_a_stream_message_may_be_is_read_with_bounded_reads(cluster, jobs, monkeypatch):
    """The websocket's message size is bounded: a longer line breaks the stream, not the triggerer's memory."""
    monkeypatch.setattr(jobs_client, "LOG_MESSAGE_MAX_BYTES", 64 * 1024, raising=False)
    script = ("print('payload-a', flush=True)\nprint('L' * 200000, flush=True)\nprint('payload-b', flush=True)\n"
              "print('::rayslice-' + 'result::42', flush=True)\n")
    sid = await jobs.submit(f"python -c {shlex.quote(script)}", submission_id=f"rsls-long-{uuid.uuid4().hex[:8]}")
    relayed: list[str] = []
    async with AsyncRayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
        follow = JobFollow(client, sid, LogFollower(relayed.append), poll=0.3, warn=lambda _: None)
        await _follow_to_end(follow)
        streamed = client.bytes_streamed
    assert follow.outcome() == 42
    assert [line for line in relayed if line.startswith(("payload-", "LLL"))] == ["payload-a", "L" * 200000,
                                                                                   "payload-b"]
    assert streamed < 200000, streamed


async def _ended(client: AsyncRayJobsClient, sid: str) -> JobStatus:
    while not (job := await client.get(sid)).is_terminal:
        await asyncio.sleep(0.3)
    return job.status
