"""A small client for the Ray Jobs REST API (the dashboard's ``/api/jobs/``), async and sync.

The Airflow side talks to Ray only through this module, so it imports nothing
but httpx, pydantic and the standard library: never ``ray``.

Layout: ``_BaseJobsClient`` writes every call once, as an *operation* (``operations``): a generator
that yields the requests to send and the back-off sleeps of the one retry loop (``_exchange``), and
parses the answers, with no I/O of its own. ``RayJobsClient`` (``httpx.Client``, blocking) and
``AsyncRayJobsClient`` (``httpx.AsyncClient``, awaitable) only run operations (``_drive``), so
both have the same methods with the same retries, errors and token scrubbing. What the calls
return and take lives beside it: job records (``job_details``), packages (``packages``), an open
log stream (``log_tail``); their public names are importable from here too, as they always were.

REST shapes, as served by Ray 2.60 (``ray/dashboard/modules/job/job_head.py``):

==========================================  =============================================
``GET /api/version``                        ``{"version": "4", "ray_version", ...}``
``POST /api/jobs/``                         ``{"submission_id", "job_id"}``; a duplicate id
                                            answers **500** whose traceback text ends in
                                            ``ValueError: Job with submission_id X already
                                            exists`` (the agent's 400, wrapped by the head)
``GET /api/jobs/``                          list of job details (submission and driver jobs)
``GET /api/jobs/{id}``                      job details; 404 text ``Job X does not exist``
``POST /api/jobs/{id}/stop``                ``{"stopped": bool}`` (False: not running)
``DELETE /api/jobs/{id}``                   ``{"deleted": true}``; 500 while not terminal
``GET /api/jobs/{id}/logs``                 ``{"logs": str}``
``GET /api/jobs/{id}/logs/tail``            websocket: the log so far, then new chunks as text
                                            messages (up to 10 lines, or one whole long line);
                                            closed (1000) once the job ended
``GET /api/v0/logs/file?node_id=&filename=  the state API's log read: the file's last ``lines``
job-driver-{id}.log&lines=N``               lines as plain text (no offset or byte range)
``GET /api/packages/{protocol}/{name}``     200 (exists; also pins the URI for 10 min), 404
``PUT /api/packages/{protocol}/{name}``     the raw package bytes; 200 with an empty body
==========================================  =============================================

With ``RAY_AUTH_MODE=token`` every path above answers 401 without an
``Authorization: Bearer`` header and 403 with a wrong token.

The log tail (``AsyncRayJobsClient.tail_logs``, async only: its followers all run in an event
loop) opens without permessage-deflate: Ray 2.60's dashboard proxies the websocket from a
subprocess and passes the client's extension header through, and a compressed stream then
closes at once with nothing (measured).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import websockets
from pydantic import ValidationError

from rayslice.client.job_details import JobDetails, JobStatus
from rayslice.client.log_tail import LogTail
from rayslice.client.operations import Call, Op, advance, operation
from rayslice.client.packages import package_name_for, split_package_uri, zip_directory
from rayslice.core.exceptions import (
    InvalidRequestError,
    JobNotFoundError,
    RayAuthError,
    RayJobsError,
    RayUnreachableError,
)

__all__ = [
    "AsyncRayJobsClient",
    "JobDetails",
    "JobStatus",
    "LogTail",
    "RayJobsClient",
    "package_name_for",
    "zip_directory",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Statuses that mean "a proxy or the dashboard is (re)starting": retried like connection errors.
RETRY_STATUSES = frozenset({502, 503, 504})
# A GET changes nothing, so any 5xx answer to one (a proxy's 500, a dashboard hiccup) is retried too.
#: The largest log-tail websocket message accepted; a bigger one (one log line longer than this) breaks the
#: stream, and the follower falls back to bounded reads (``log_lines``).
LOG_MESSAGE_MAX_BYTES = 8 * 2**20
_MAX_TEXT = 500
_AUTH_HINT = "set the `ray` connection's password to the cluster's token"
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*$")


@functools.lru_cache(maxsize=2)
def _default_tls(verify: bool) -> ssl.SSLContext:
    """httpx's own TLS settings for `verify=True` (its CA bundle) or `False`, built once per process.

    httpx builds them for every client, loading the CA bundle each time (about 40 ms): a triggerer
    starting hundreds of deferred steps at once builds a client per step. One context serves them all.
    """
    return httpx.create_ssl_context(verify=verify)


# --------------------------------------------------------------------------- base client


def _quote(value: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{what} must be a non-empty string, got {value!r}")
    return quote(value, safe="")


def _check_runtime_env(runtime_env: dict[str, Any]) -> None:
    """Reject local paths in working_dir / py_modules: this client only passes URIs through."""
    if not isinstance(runtime_env, dict):
        raise InvalidRequestError(f"runtime_env must be a dict, got {type(runtime_env).__name__}")
    locations: list[Any] = []
    if runtime_env.get("working_dir") is not None:
        locations.append(runtime_env["working_dir"])
    py_modules = runtime_env.get("py_modules")
    if py_modules is not None:
        if not isinstance(py_modules, list):
            raise InvalidRequestError("runtime_env['py_modules'] must be a list of URIs")
        locations.extend(py_modules)
    for loc in locations:
        if not isinstance(loc, str) or "://" not in loc:
            raise InvalidRequestError(
                f"runtime_env working_dir/py_modules entries must be URIs (e.g. gcs://...), "
                f"got {loc!r}; upload local code with ensure_package(zip_directory(...)) first"
            )


class _BaseJobsClient:
    """Request building and response parsing for the Ray Jobs API; no I/O here."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        verify: bool | str = True,
        headers: dict[str, str] | None = None,
        timeout: float = 10.0,
        retries: int = 3,
        backoff: float = 0.5,
    ) -> None:
        address = (address or "").strip()
        if not address:
            raise InvalidRequestError("the Ray dashboard address is empty")
        if "://" not in address:
            address = f"http://{address}"
        url = httpx.URL(address)
        if url.scheme not in ("http", "https") or not url.host:
            raise InvalidRequestError(
                f"the Ray dashboard address must be http(s)://host:port, got "
                f"{str(url.copy_with(username=None, password=None))!r}"
            )
        if timeout is None or timeout <= 0:
            raise InvalidRequestError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if backoff < 0:
            raise InvalidRequestError(f"backoff must be >= 0, got {backoff!r}")
        self._base_url = url.copy_with(path=url.path.rstrip("/") or "", query=None, fragment=None)
        # For messages and repr: never the userinfo of an address, never the token.
        self.address = str(self._base_url.copy_with(username=None, password=None))
        self._token = token or None
        user_auth = {k: v for k, v in (headers or {}).items() if k.lower() == "authorization"}
        self._headers = {k: v for k, v in (headers or {}).items() if k.lower() != "authorization"}
        if self._token is not None:
            self._headers["Authorization"] = f"Bearer {self._token}"
        else:  # an Authorization header given by hand is as secret as a token
            self._headers.update(user_auth)
        self._secrets = [s for s in (self._token, *user_auth.values(), url.password) if s]
        # Every configured header may carry a credential (a proxy's key): its value never reaches a message.
        self._header_values = sorted({v for k, v in (headers or {}).items()
                                      if k.lower() != "authorization" and len(str(v)) >= 3}, key=len, reverse=True)
        self._verify = self._ssl_verify(verify)
        self.timeout = float(timeout)
        self.retries = max(1, int(retries))
        self.backoff = float(backoff)
        #: Bytes of log text received over log-tail websockets, for measuring what following costs.
        self.bytes_streamed = 0

    def __repr__(self) -> str:
        auth = "token" if self._secrets else "none"
        return f"{type(self).__name__}(address={self.address!r}, auth={auth!r})"

    @staticmethod
    def _ssl_verify(verify: bool | str) -> ssl.SSLContext:
        if isinstance(verify, bool):
            return _default_tls(verify)
        if os.path.isdir(verify):
            return ssl.create_default_context(capath=verify)
        if os.path.isfile(verify):
            return ssl.create_default_context(cafile=verify)
        raise InvalidRequestError(f"verify: CA bundle path {verify!r} does not exist")

    def _client_kwargs(self, transport: Any) -> dict[str, Any]:
        return {
            "base_url": self._base_url,
            "headers": self._headers,
            "verify": self._verify,
            "timeout": httpx.Timeout(self.timeout),
            "transport": transport,
            "follow_redirects": False,
        }

    # ---- secrets and text

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "<token>")
        for value in self._header_values:
            text = text.replace(value, "<header>")
        return text

    def _summary(self, text: str) -> str:
        """The useful part of a server answer: for Ray's tracebacks, the last exception line."""
        text = self._scrub(text or "").strip()
        if "Traceback (most recent call last)" in text:
            lines = [ln.strip() for ln in text.splitlines() if _EXC_LINE.match(ln.strip())]
            if lines:
                text = lines[-1]
        if len(text) > _MAX_TEXT:
            text = text[: _MAX_TEXT - 3] + "..."
        return text or "<empty body>"

    # ---- retry policy

    def _delay(self, attempt: int) -> float:
        return self.backoff * 2**attempt

    def _transient(self, call: Call, attempt: int, cause: str) -> float | None:
        """Note a transient failure; the seconds to sleep before retrying, or None when out of tries."""
        if attempt + 1 >= self.retries:
            return None
        delay = self._delay(attempt)
        logger.warning(
            "Ray dashboard at %s: %s failed (%s); attempt %d/%d, retrying in %.2fs",
            self.address, call.label, cause, attempt + 1, self.retries, delay,
        )
        return delay

    def _unreachable(self, cause: str, status_code: int | None = None) -> RayUnreachableError:
        return RayUnreachableError(
            f"could not reach the Ray dashboard at {self.address} after {self.retries} attempts: "
            f"{cause}; check the `ray` connection's host and that the cluster is up",
            status_code=status_code,
        )

    def _exc_cause(self, exc: httpx.TransportError) -> str:
        detail = self._scrub(str(exc)) or "no detail"
        return f"{type(exc).__name__}: {detail}"

    # ---- response checking

    def _raise_for_status(self, call: Call, resp: httpx.Response, *, not_found: str | None) -> None:
        code = resp.status_code
        if 200 <= code < 300:
            return
        if code == 401:
            raise RayAuthError(
                f"the Ray dashboard at {self.address} requires a token (HTTP 401 on {call.label}); "
                f"{_AUTH_HINT}",
                status_code=code,
            )
        if code == 403:
            what = "rejected the token" if self._token else "refused the request"
            raise RayAuthError(
                f"the Ray dashboard at {self.address} {what} (HTTP 403 on {call.label}: "
                f"{self._summary(resp.text)}); {_AUTH_HINT}",
                status_code=code,
            )
        if code == 404 and not_found is not None:
            raise JobNotFoundError(
                f"the Ray dashboard at {self.address} knows no job {not_found!r}", status_code=code
            )
        raise RayJobsError(
            f"the Ray dashboard at {self.address} answered {call.label} with HTTP {code}: "
            f"{self._summary(resp.text)}",
            status_code=code,
        )

    def _json(self, call: Call, resp: httpx.Response, kind: type | None = None, what: str = "") -> Any:
        """The JSON body; with ``kind``, one of that type (``what`` names it in the error)."""
        try:
            body = resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RayJobsError(
                f"the Ray dashboard at {self.address} answered {call.label} with a body that is "
                f"not JSON (HTTP {resp.status_code}): {self._summary(resp.text)!r}",
                status_code=resp.status_code,
            ) from None
        if kind is not None and not isinstance(body, kind):
            raise RayJobsError(
                f"the Ray dashboard at {self.address} answered {call.label} with "
                f"{type(body).__name__} {self._summary(resp.text)!r}, not {what}",
                status_code=resp.status_code,
            )
        return body

    def _field(self, call: Call, resp: httpx.Response, key: str, kind: type) -> Any:
        body = self._json(call, resp)
        if not isinstance(body, dict) or not isinstance(body.get(key), kind):
            raise RayJobsError(
                f"the Ray dashboard at {self.address} answered {call.label} without a "
                f"{kind.__name__} {key!r}: {self._summary(resp.text)!r}",
                status_code=resp.status_code,
            )
        return body[key]

    def _details(self, call: Call, resp: httpx.Response, raw: Any) -> JobDetails:
        try:
            return JobDetails.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in exc.errors()
            )
            raise RayJobsError(
                f"the Ray dashboard at {self.address} answered {call.label} with unexpected job "
                f"details ({problems})",
                status_code=resp.status_code,
            ) from None

    # ---- the calls, each written once as an operation (see ``operation``)

    def _exchange(self, call: Call) -> Op[httpx.Response]:
        """Send ``call`` under the retry policy: the one retry loop, run by both clients' ``_drive``."""
        for attempt in range(self.retries):
            try:
                resp = yield call
            except httpx.TransportError as exc:
                cause = self._exc_cause(exc)
                delay = self._transient(call, attempt, cause)
                if delay is None:
                    raise self._unreachable(cause) from exc
            else:
                if resp.status_code not in RETRY_STATUSES and not (call.method == "GET" and resp.status_code >= 500):
                    return resp
                cause = f"HTTP {resp.status_code} on {call.label}: {self._summary(resp.text)}"
                delay = self._transient(call, attempt, cause)
                if delay is None:
                    raise self._unreachable(cause, resp.status_code)
            yield delay
        raise AssertionError("unreachable")  # pragma: no cover

    def _drive(self, op: Op[T]) -> Any:
        """Run an operation to its result: the sync client blocks, the async one returns a coroutine."""
        raise NotImplementedError

    def _steps(self, name: str, *args: Any, **kwargs: Any) -> Op[Any]:
        """Another operation's steps, so operations compose: ``yield from self._steps("package_exists", uri)``."""
        return getattr(type(self), name).__wrapped__(self, *args, **kwargs)

    @operation
    def version(self) -> Op[dict[str, Any]]:
        """``GET /api/version``: ``{"version", "ray_version", "ray_commit", "session_name"}``."""
        call = Call("GET", "/api/version")
        resp = yield from self._exchange(call)
        if resp.status_code == 404:
            raise RayJobsError(
                f"{self.address} does not look like a Ray dashboard (404 on {call.label}); "
                "check the `ray` connection's host and port",
                status_code=404,
            )
        self._raise_for_status(call, resp, not_found=None)
        return self._json(call, resp, dict, "an object")

    @operation
    def submit(
        self,
        entrypoint: str,
        *,
        submission_id: str,
        runtime_env: dict[str, Any] | None = None,
        metadata: dict[str, str] | None = None,
        entrypoint_num_cpus: float | None = None,
        entrypoint_num_gpus: float | None = None,
        entrypoint_memory: int | None = None,
        entrypoint_resources: dict[str, float] | None = None,
        entrypoint_label_selector: dict[str, str] | None = None,
    ) -> Op[str]:
        """Submit a job; idempotent by ``submission_id`` (an existing job's id is returned, not an error)."""
        if not isinstance(entrypoint, str) or not entrypoint.strip():
            raise InvalidRequestError(f"entrypoint must be a non-empty command string, got {entrypoint!r}")
        _quote(submission_id, "submission_id")
        if runtime_env is not None:
            _check_runtime_env(runtime_env)
        if metadata is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise InvalidRequestError("metadata keys and values must all be strings")
        body = {
            "entrypoint": entrypoint,
            "submission_id": submission_id,
            "runtime_env": runtime_env,
            "metadata": metadata,
            "entrypoint_num_cpus": entrypoint_num_cpus,
            "entrypoint_num_gpus": entrypoint_num_gpus,
            "entrypoint_memory": entrypoint_memory,
            "entrypoint_resources": entrypoint_resources,
            "entrypoint_label_selector": entrypoint_label_selector,
        }
        # Like Ray's own client: leave out unset fields, so older servers accept the request.
        call = Call("POST", "/api/jobs/", json={k: v for k, v in body.items() if v is not None})
        resp = yield from self._exchange(call)
        if resp.status_code >= 400 and self._already_exists(resp.text, submission_id):
            logger.info(
                "Ray dashboard at %s: job %r already exists; reattaching to it",
                self.address, submission_id,
            )
            return submission_id
        self._raise_for_status(call, resp, not_found=None)
        answer = self._json(call, resp)
        returned = answer.get("submission_id") if isinstance(answer, dict) else None
        return returned if isinstance(returned, str) and returned else submission_id

    @staticmethod
    def _already_exists(text: str, submission_id: str) -> bool:
        # Ray 2.60: HTTP 500 whose traceback ends "ValueError: Job with submission_id <id>
        # already exists. Please use a different submission_id." (older Rays: 400).
        return "already exists" in text and submission_id in text

    def _job(self, method: str, submission_id: str, suffix: str = "") -> Op[tuple[Call, httpx.Response]]:
        """One call about a job; its 404 is ``JobNotFoundError``, any other error status raises."""
        call = Call(method, f"/api/jobs/{_quote(submission_id, 'submission_id')}{suffix}")
        resp = yield from self._exchange(call)
        self._raise_for_status(call, resp, not_found=submission_id)
        return call, resp

    @operation
    def get(self, submission_id: str) -> Op[JobDetails]:
        """The job's details; ``JobNotFoundError`` when the dashboard does not know the id."""
        call, resp = yield from self._job("GET", submission_id)
        return self._details(call, resp, self._json(call, resp))

    @operation
    def stop(self, submission_id: str) -> Op[bool]:
        """Ask the job to stop; True if it was running (the stop itself is asynchronous)."""
        return self._field(*(yield from self._job("POST", submission_id, "/stop")), "stopped", bool)

    @operation
    def delete(self, submission_id: str) -> Op[bool]:
        """Delete a terminal job's record; a job still running gives ``RayJobsError`` (HTTP 500)."""
        return self._field(*(yield from self._job("DELETE", submission_id)), "deleted", bool)

    @operation
    def logs(self, submission_id: str) -> Op[str]:
        """The job's driver log so far (``""`` before the driver started)."""
        return self._field(*(yield from self._job("GET", submission_id, "/logs")), "logs", str)

    @operation
    def log_lines(self, job: JobDetails, lines: int) -> Op[str]:
        """The last ``lines`` lines of the job's driver log: a read bounded by lines, not the whole log.

        Ray's Jobs API has no range read; the state API reads the driver's log file on its node
        (``driver_node_id`` of the job's details) from the end.
        """
        sid = job.submission_id or ""
        _quote(sid, "submission_id")
        node = (job.model_extra or {}).get("driver_node_id")
        if not node:
            raise RayJobsError(f"the Ray dashboard at {self.address} gave no driver node for job {sid!r}: "
                               "its log cannot be read in part")
        call = Call("GET", "/api/v0/logs/file", params={
            "node_id": str(node), "filename": f"job-driver-{sid}.log",
            "lines": str(max(1, int(lines)))})
        resp = yield from self._exchange(call)
        self._raise_for_status(call, resp, not_found=None)
        return resp.content.decode("utf-8", "replace")

    @operation
    def list_jobs(self) -> Op[list[JobDetails]]:
        """Every job the cluster knows: submission jobs and plain driver jobs (``type``)."""
        call = Call("GET", "/api/jobs/")
        resp = yield from self._exchange(call)
        self._raise_for_status(call, resp, not_found=None)
        return [self._details(call, resp, item) for item in self._json(call, resp, list, "a list of jobs")]

    @operation
    def get_json(self, path: str, params: dict[str, str] | None = None) -> Op[Any]:
        """``GET path`` on the dashboard (e.g. the state API's ``/api/v0/nodes``): its JSON body.

        The same retries, token, TLS settings and errors as every other call; the capacity reader
        (``rayslice.client.capacity``) reads the state API through it.
        """
        if not isinstance(path, str) or not path.startswith("/"):
            raise InvalidRequestError(f"path must start with '/', got {path!r}")
        call = Call("GET", path, params=params)
        resp = yield from self._exchange(call)
        self._raise_for_status(call, resp, not_found=None)
        return self._json(call, resp)

    @operation
    def package_exists(self, uri: str) -> Op[bool]:
        """Whether the cluster holds ``uri`` (``gcs://...``); asking also pins it for ~10 min."""
        protocol, name = split_package_uri(uri)
        call = Call("GET", f"/api/packages/{quote(protocol, safe='')}/{quote(name, safe='')}")
        resp = yield from self._exchange(call)
        if resp.status_code == 404:
            return False
        self._raise_for_status(call, resp, not_found=None)
        return True

    @operation
    def upload_package(self, name: str, data: bytes, *, timeout: float | None = None) -> Op[str]:
        """Store ``data`` in the cluster as ``gcs://<name>``; returns that URI."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidRequestError(f"package data must be bytes, got {type(data).__name__}")
        uri = name if "://" in name else f"gcs://{name}"
        protocol, pkg = split_package_uri(uri)
        if protocol != "gcs":
            raise InvalidRequestError(f"only gcs:// packages can be uploaded, got {uri!r}")
        call = Call("PUT", f"/api/packages/gcs/{quote(pkg, safe='')}", content=bytes(data), timeout=timeout)
        self._raise_for_status(call, (yield from self._exchange(call)), not_found=None)
        return uri

    @operation
    def ensure_package(self, zip_bytes: bytes, *, timeout: float | None = None) -> Op[str]:
        """Upload ``zip_bytes`` under its content hash unless the cluster has it; returns the URI."""
        uri = f"gcs://{package_name_for(bytes(zip_bytes))}"
        # Asking first also pins the URI, as Ray's own client does before uploading.
        if not (yield from self._steps("package_exists", uri)):
            yield from self._steps("upload_package", uri, zip_bytes, timeout=timeout)
        return uri

    # ---- the log tail (a websocket: async only)

    def _tail_call(self, submission_id: str) -> Call:
        return Call("GET", f"/api/jobs/{_quote(submission_id, 'submission_id')}/logs/tail")

    def _ws_url(self, call: Call) -> str:
        scheme = "wss" if self._base_url.scheme == "https" else "ws"
        return str(self._base_url.copy_with(scheme=scheme, path=self._base_url.path.rstrip("/") + call.path))

    def _ws_ssl(self) -> ssl.SSLContext | None:
        """The TLS settings of the HTTP calls, for ``wss://``: the same CA bundle, or no verification."""
        if self._base_url.scheme != "https":
            return None
        return self._verify

    def _tail_refused(self, call: Call, exc: websockets.InvalidStatus, submission_id: str) -> Exception:
        """The HTTP answer that refused the websocket, as the error a plain call would raise."""
        code = exc.response.status_code
        resp = httpx.Response(code, content=bytes(exc.response.body or b""))
        if code in RETRY_STATUSES:
            return RayUnreachableError(
                f"the Ray dashboard at {self.address} answered {call.label} with HTTP {code}", status_code=code
            )
        try:
            self._raise_for_status(call, resp, not_found=submission_id)
        except RayJobsError as err:
            return err
        return RayJobsError(
            f"the Ray dashboard at {self.address} answered {call.label} with HTTP {code}, not a websocket",
            status_code=code,
        )

# --------------------------------------------------------------------------- the two clients


class AsyncRayJobsClient(_BaseJobsClient):
    """Ray Jobs API over ``httpx.AsyncClient``: ``await client.get(sid)``. Use as ``async with`` or ``aclose()``.

    ``retries`` is the number of attempts a call gets when the dashboard is
    unreachable, times out or answers 502/503/504; attempt ``i`` is followed by
    a sleep of ``backoff * 2**i`` seconds. ``timeout`` bounds each attempt. ``options``: ``token``,
    ``verify`` (bool or a CA bundle path), ``headers``, ``timeout``, ``retries``, ``backoff``.
    """

    def __init__(self, address: str, *, transport: httpx.AsyncBaseTransport | None = None, **options: Any) -> None:
        super().__init__(address, **options)
        self._client = httpx.AsyncClient(**self._client_kwargs(transport))

    async def __aenter__(self) -> AsyncRayJobsClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _drive(self, op: Op[T]) -> T:
        """Run an operation: send its calls, sleep its back-offs, without blocking the event loop."""
        step, result = advance(op, None)
        while step is not None:
            try:
                reply = await (self._client.request(**step.request) if isinstance(step, Call)
                               else asyncio.sleep(step))
            except httpx.TransportError as exc:
                reply = exc
            step, result = advance(op, reply)
        return result

    @asynccontextmanager
    async def tail_logs(self, submission_id: str) -> AsyncIterator[LogTail]:
        """Open the job's log tail websocket: ``async with client.tail_logs(sid) as tail``.

        Each stream starts again at the log's first character. Opening is one attempt bounded by
        ``timeout``: a dashboard that does not answer gives ``RayUnreachableError``; 401/403/404
        give the errors the other calls give. The token, extra headers and TLS settings are the
        HTTP calls' own.
        """
        call = self._tail_call(submission_id)
        try:
            ws = await websockets.connect(
                self._ws_url(call),
                additional_headers=self._headers,
                ssl=self._ws_ssl(),
                open_timeout=self.timeout,
                # Leaving a stream must be quick (a timeout or a kill stops the job right after): Ray's
                # tail handler only writes, so it never answers our close frame; do not wait for it.
                close_timeout=0.1,
                compression=None,  # see the module docstring: Ray's proxy drops compressed streams
                # The server sends up to 10 lines per message, or one whole long line: bounded, so one
                # huge line cannot take the triggerer's memory; it breaks the stream instead.
                max_size=LOG_MESSAGE_MAX_BYTES,
                # No keepalive pings: Ray's dashboard, busy relaying a chatty log, answers them late,
                # and each "keepalive ping timeout" cost a reopen that re-sent the whole log (measured:
                # 3.6x a 20 MB log's bytes). A dead stream is noticed through the status polls instead.
                ping_interval=None,
            )
        except websockets.InvalidStatus as exc:
            raise self._tail_refused(call, exc, submission_id) from None
        except (OSError, TimeoutError, websockets.InvalidHandshake) as exc:
            cause = self._scrub(f"{type(exc).__name__}: {exc}")
            raise RayUnreachableError(
                f"could not open the log stream {call.label} at {self.address}: {cause}"
            ) from None
        try:
            yield LogTail(self, ws, submission_id)
        finally:
            await ws.close()


class RayJobsClient(_BaseJobsClient):
    """Ray Jobs API over ``httpx.Client``: the same calls and ``options`` as ``AsyncRayJobsClient``, blocking."""

    def __init__(self, address: str, *, transport: httpx.BaseTransport | None = None, **options: Any) -> None:
        super().__init__(address, **options)
        self._client = httpx.Client(**self._client_kwargs(transport))

    def __enter__(self) -> RayJobsClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def _drive(self, op: Op[T]) -> T:
        """Run an operation: send its calls, sleep its back-offs."""
        step, result = advance(op, None)
        while step is not None:
            step, result = advance(op, self._io(step))
        return result

    def _io(self, step: Call | float) -> httpx.Response | httpx.TransportError | None:
        if not isinstance(step, Call):
            return time.sleep(step)
        try:
            return self._client.request(**step.request)
        except httpx.TransportError as exc:
            return exc
