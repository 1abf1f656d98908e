"""A followed job's end is acted on when a status poll sees it, not when the lagging log stream catches up.

The dashboard streams a log's new lines a second or more late (issue 52: about 1.6 s a step on a chain
of short steps). Here a stand-in client's stream delivers the first lines, then nothing more (a stream
that lags without end); the status says the job ended; the log's end (a bounded read) holds the rest,
marker line included. The follow must finish from that read, every line relayed once and in order,
and leave a stream that lags where the read cannot reach back to the last line relayed.
"""

from __future__ import annotations

import asyncio
import contextlib

from rayslice.client.jobs_client import JobDetails, JobStatus
from rayslice.client.submission import JobFollow, LogFollower

LOG = "".join(f"line-{i}\n" for i in range(6)) + "::rayslice-result::42\n"


class LaggingStream:
    def __init__(self, first: str) -> None:
        self.first, self.sent = first, False

    async def next(self) -> str | None:
        if not self.sent:
            self.sent = True
            return self.first
        await asyncio.Event().wait()  # the rest never comes over the stream (it lags past the test)
        return None


class Client:
    def __init__(self, first: str, window: str) -> None:
        self.first, self.window, self.polls, self.reads = first, window, 0, 0

    async def get(self, sid: str) -> JobDetails:
        self.polls += 1
        status = JobStatus.RUNNING if self.polls == 1 else JobStatus.SUCCEEDED
        return JobDetails(status=status, submission_id=sid)

    @contextlib.asynccontextmanager
    async def tail_logs(self, sid: str):
        yield LaggingStream(self.first)

    async def log_lines(self, job: JobDetails, lines: int) -> str:
        self.reads += 1
        return self.window


async def _follow(client: Client) -> tuple[JobFollow, list[str]]:
    relayed: list[str] = []
    follow = JobFollow(client, "job-1", LogFollower(relayed.append), poll=0.05, warn=lambda _: None)
    follow.END_GRACE_S = 3600.0  # the old way out (a bounded read that long after the end) never comes here

    async def run() -> None:
        async for _ in follow.statuses():
            pass

    await asyncio.wait_for(run(), 30)  # a hang guard only: the follow ends at once or never
    return follow, relayed


def test_the_end_seen_by_a_poll_completes_the_log_from_a_bounded_read_not_the_lagging_stream():
    client = Client(first="line-0\nline-1\n", window=LOG)
    follow, relayed = asyncio.run(_follow(client))
    assert follow.outcome() == 42
    assert relayed == [f"line-{i}" for i in range(6)]  # each once, in order: the read is placed after line-1
    assert client.reads == 1


def test_a_read_that_does_not_reach_back_to_the_last_line_relayed_leaves_the_stream_to_finish():
    """A log that grew past the read between the stream and the end: the read is not used (no line skipped)."""
    client = Client(first="line-0\nline-1\n", window="line-5\n::rayslice-result::42\n")
    relayed: list[str] = []
    follow = JobFollow(client, "job-1", LogFollower(relayed.append), poll=0.05, warn=lambda _: None)
    follow.END_GRACE_S = 3600.0

    async def run() -> bool:
        async def statuses() -> None:
            async for _ in follow.statuses():
                pass

        task = asyncio.ensure_future(statuses())
        while client.polls < 10:  # the end was seen, the read tried, and polls went on after it
            await asyncio.sleep(0.01)
        done = task.done()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return done

    assert asyncio.run(asyncio.wait_for(run(), 30)) is False  # still following the stream
    assert client.reads >= 1 and relayed == ["line-0", "line-1"] and not follow.complete
