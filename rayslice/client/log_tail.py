"""Reading one job's log-tail websocket, chunk by chunk, and telling a normal end from a broken one.

The Jobs client opens the stream (``AsyncRayJobsClient.tail_logs``: the address, token, TLS and
limits are its own); this is what the follower then reads. A stream that ends other than by the
server's normal close may have stopped short of the log's end, and says so, so that the follower
falls back to polling instead of taking a cut log for a whole one.
"""

from __future__ import annotations

from typing import Any, Protocol

import websockets

from rayslice.core.exceptions import RayUnreachableError

__all__ = ["LogTail", "TailOwner"]


class TailOwner(Protocol):
    """What a stream needs of the client that opened it: its address and scrubbing for errors, a byte count."""

    address: str
    bytes_streamed: int

    def _scrub(self, text: str) -> str: ...


class LogTail:
    """One open log-tail websocket of a job (from ``AsyncRayJobsClient.tail_logs``)."""

    def __init__(self, client: TailOwner, ws: Any, submission_id: str) -> None:
        self._client = client
        self._ws = ws
        self.submission_id = submission_id

    async def next(self) -> str | None:
        """The next chunk of log text; None once the server closed the stream normally (code 1000).

        Safe to cancel (e.g. by ``asyncio.wait_for``): a chunk that arrives meanwhile is kept for
        the next call. Any other end (a cut connection, a dashboard going away) raises
        ``RayUnreachableError``: the stream may have stopped short of the log's end.
        """
        try:
            message = await self._ws.recv()
        except websockets.ConnectionClosed as exc:
            if exc.rcvd is not None and exc.rcvd.code == 1000:
                return None
            raise RayUnreachableError(
                f"the log stream of Ray job {self.submission_id} from {self._client.address} broke off: "
                f"{self._client._scrub(str(exc))}"
            ) from None
        if isinstance(message, bytes):
            self._client.bytes_streamed += len(message)
            return message.decode("utf-8", "replace")
        self._client.bytes_streamed += len(message.encode("utf-8", "replace"))
        return message
