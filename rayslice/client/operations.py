"""How the Jobs client writes each call once for both of its I/O layers: an operation.

An operation is a generator that yields the requests to send (``Call``) and the seconds to sleep
before a retry (``float``), receives each response (or the transport error, thrown in), and returns
the call's result, with no I/O of its own. ``RayJobsClient`` (blocking) and ``AsyncRayJobsClient``
(awaitable) only run operations (their ``_drive``, each step through ``advance``), so both have the
same methods with the same retries, errors and token scrubbing, and a test can drive one by hand.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

__all__ = ["Call", "Op", "advance", "operation"]

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """One request to make: what the I/O layers send, and what parsers describe in errors."""

    method: str
    path: str
    json: Any = None
    content: bytes | None = None
    timeout: float | None = None
    params: dict[str, str] | None = None

    @property
    def label(self) -> str:
        return f"{self.method} {self.path}"

    @property
    def request(self) -> dict[str, Any]:
        """The arguments of ``httpx.Client.request`` / ``httpx.AsyncClient.request``."""
        timeout = httpx.Timeout(self.timeout) if self.timeout else httpx.USE_CLIENT_DEFAULT
        return {"method": self.method, "url": self.path, "json": self.json, "content": self.content,
                "params": self.params, "timeout": timeout}


#: An operation: a generator that yields the requests to send (``Call``) and the seconds to sleep
#: before a retry (``float``), receives each response (or the transport error, thrown in), and
#: returns the call's result. Written once; the sync and the async client only run it (``_drive``).
Op = Generator[Call | float, Any, T]


def operation(steps: Callable[..., Op[T]]) -> Callable[..., Any]:
    """A client method from an operation: blocking on ``RayJobsClient``, awaitable on ``AsyncRayJobsClient``."""

    @functools.wraps(steps)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:  # a Jobs client: its `_drive` runs the steps
        return self._drive(steps(self, *args, **kwargs))

    return method


def advance(op: Op[T], reply: httpx.Response | BaseException | None) -> tuple[Call | float | None, Any]:
    """Give ``op`` its last step's outcome; (its next step, None), or (None, its result) once it returned."""
    try:
        return op.throw(reply) if isinstance(reply, BaseException) else op.send(reply), None
    except StopIteration as done:
        return None, done.value
