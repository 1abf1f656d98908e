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


def test_a_read_of_a_log_of_repeated_lines_relays_each_line_the_stream_had_not_brought():
    """A step that prints the same line over and over: the read is placed where the stream stopped, not after
    the last run of lines that look like the last ones relayed (no line lost)."""
    log = "working\n" * 10 + "::rayslice-result::42\n"
    client = Client(first="working\n" * 3, window=log)
    follow, relayed = asyncio.run(_follow(client))
    assert follow.outcome() == 42
    assert relayed == ["working"] * 10


class BehindStream:
    """Streams the log's first lines, then, once the log's end was read, the rest, and closes."""

    def __init__(self, client: HugeLogClient) -> None:
        self.client, self.step = client, 0

    async def next(self) -> str | None:  # a wait cut short (the follow polls meanwhile) loses nothing, as a socket's
        if self.step == 1:
            while not self.client.reads:
                await asyncio.sleep(0.01)
        self.step += 1
        if self.step == 1:
            return self.client.log[:self.client.streamed]
        return self.client.log[self.client.streamed:] if self.step == 2 else None


class HugeLogClient(Client):
    """A log far longer than a bounded read; `log_lines` returns its last `lines` lines, as Ray's state API."""

    def __init__(self, log: str, streamed: int) -> None:
        super().__init__(first="", window="")
        self.log, self.streamed = log, streamed

    @contextlib.asynccontextmanager
    async def tail_logs(self, sid: str):
        yield BehindStream(self)

    async def log_lines(self, job: JobDetails, lines: int) -> str:
        self.reads += 1
        return "".join(self.log.splitlines(keepends=True)[-lines:])


def test_a_read_that_does_not_reach_back_is_not_placed_by_a_line_that_only_looks_like_the_last_relayed():
    """A huge log with a blank line every ten: the stream stopped after one, and the read's first line is one too.

    The read reaches back nowhere near the last line relayed; taking its first blank line for that one
    would drop the thousands of lines between without a word. The stream brings them instead.
    """
    body = ["" if i % 10 == 0 else f"line-{i}" for i in range(19999)]
    log = "".join(f"{line}\n" for line in body) + "::rayslice-result::42\n"
    client = HugeLogClient(log, streamed=len("".join(f"{line}\n" for line in body[:11])))
    follow, relayed = asyncio.run(_follow(client))
    assert follow.outcome() == 42
    assert relayed == [line for line in body if line]


def test_a_marker_line_the_stream_cut_in_two_is_read_whole_from_the_logs_end():
    """The stream brought half the marker line when the poll saw the end: the read relays it whole, once."""
    cut = LOG.index("::rayslice-result::") + 8
    client = Client(first=LOG[:cut], window=LOG)
    follow, relayed = asyncio.run(_follow(client))
    assert follow.outcome() == 42
    assert relayed == [f"line-{i}" for i in range(6)]
    assert follow.lines.offset == len(LOG)
