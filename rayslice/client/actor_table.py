"""The dashboard's actor table, read and cut down to a window's step processes in a child process.

Ray 2.60's `/logical/actors` filters by actor id only, so the usage timeline must read the whole
table: up to 100,000 ended actors, over 100 MiB of JSON. Decoding that is one long C call that
holds the GIL, so in a thread it still stops the caller's event loop for as long (in the Airflow
API server, that loop also serves the task Execution API). A child process does the reading and
the decoding and hands back only the rayslice host processes that overlap the window, with the
fields `usage.parse` reads: a few percent of the table.

The child gets its request (including the token and headers) on stdin, never on its command line.

    python -m rayslice.client.actor_table < request.json > actors.json
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from rayslice.client.capacity import PREFIX, _int
from rayslice.core import exceptions
from rayslice.core.exceptions import RaysliceError

__all__ = ["aread_window", "window"]

# `nocache=1`: otherwise the dashboard answers an expired cached reply, maybe minutes old, and refreshes it after.
_ACTORS = ("/logical/actors", {"nocache": "1"})
_KEEP = ("name", "state", "startTime", "endTime", "requiredResources")
#: Beyond the client's own timeout (and its retries): a child that hangs anyway is killed.
_SLACK_S = 30.0


def _ms(value: Any) -> float | None:
    """Ray's milliseconds since the epoch as seconds; None for 0 (not yet) or junk."""
    ms = _int(value, 0)
    return ms / 1000 if ms > 0 else None


def window(actors_body: Any, *, now: float, hours: float) -> dict[str, Any]:
    """`actors_body` with only the step host processes `usage.parse` would count for `[now - hours, now]`.

    Also kept: the earliest-started step process of the table (ended before the window, it is not
    counted), from which the page says how far back Ray remembers.
    """
    since = now - hours * 3600
    actors = ((actors_body or {}).get("data", {}).get("actors") or {}) if isinstance(actors_body, dict) else {}
    kept: dict[str, Any] = {}
    oldest: tuple[float, str, dict[str, Any]] | None = None
    for actor_id, actor in actors.items():
        if not isinstance(actor, dict) or not str(actor.get("name") or "").startswith(PREFIX):
            continue
        start = _ms(actor.get("startTime"))
        if start is None:
            continue
        slim = {k: actor.get(k) for k in _KEEP}
        slim["address"] = {"nodeId": (actor.get("address") or {}).get("nodeId")}
        end = _ms(actor.get("endTime")) if actor.get("state") == "DEAD" else None
        if end is None or end >= since:
            kept[actor_id] = slim
        elif oldest is None or start < oldest[0]:
            oldest = (start, actor_id, slim)
    if oldest is not None:  # ended before the window: `parse` only reads its start
        kept[oldest[1]] = oldest[2]
    return {"data": {"actors": kept}}


async def aread_window(*, dashboard_url: str, token: str | None, timeout: float, verify: bool | str,
                       headers: dict[str, str] | None, now: float, hours: float) -> dict[str, Any]:
    """`window(<the dashboard's actor table>)`, read and cut in a child process; its errors raised here."""
    request = json.dumps({"dashboard_url": dashboard_url, "token": token, "timeout": timeout, "verify": verify,
                          "headers": headers or {}, "now": now, "hours": hours}).encode()
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", __name__, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(child.communicate(request), timeout * 4 + _SLACK_S)
    except BaseException:  # cancelled, or hung past every retry: no child outlives its reader
        if child.returncode is None:
            child.kill()
            await child.wait()
        raise
    answer = await asyncio.to_thread(json.loads, out) if out.strip() else None
    if child.returncode == 0 and isinstance(answer, dict) and "data" in answer:
        return answer
    if isinstance(answer, dict) and "error" in answer:
        cls = getattr(exceptions, str(answer["error"]), RaysliceError)
        raise (cls if isinstance(cls, type) and issubclass(cls, RaysliceError) else RaysliceError)(answer["message"])
    tail = err.decode(errors="replace").strip().splitlines()[-3:]
    raise RaysliceError(f"reading the Ray dashboard's actor table failed (exit code {child.returncode}): "
                        + " | ".join(tail))


def _main() -> int:
    from rayslice.client.jobs_client import RayJobsClient

    request = json.loads(sys.stdin.buffer.read())
    try:
        with RayJobsClient(request["dashboard_url"], token=request["token"], timeout=request["timeout"],
                           verify=request["verify"], headers=request["headers"]) as client:
            body = client.get_json(*_ACTORS)
    except RaysliceError as exc:  # already in the user's words, secrets scrubbed by the client
        json.dump({"error": type(exc).__name__, "message": str(exc)}, sys.stdout)
        return 1
    json.dump(window(body, now=request["now"], hours=request["hours"]), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
