"""The Ray job records the Slices page names holders and bars by: fetched by id, ended ones kept.

Listing every job (`GET /api/jobs/`) on each refresh costs the cluster's whole history (10,000
jobs: megabytes, parsed every few seconds). The page only needs the jobs its live holders and
its timeline's bars name, and a job that ended never changes: `JobRecords` keeps ended jobs'
records (the few fields the page reads), fetches the others by id (`GET /api/jobs/<id>`, which
takes a submission id or a job id), and falls back to one list when more than `LIST_ABOVE` are
unknown (a first refresh after a busy week). A record Ray no longer has (deleted) is remembered
as gone for `GONE_S`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

from rayslice.core.exceptions import RaysliceError

__all__ = ["JobRecords", "records_for"]

TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
LIST_ABOVE = 32  # more unknown ids than this: one list costs less than a GET each
GONE_S = 60.0  # a deleted record is not asked for again for this long
KEEP = 200_000  # ended records kept per dashboard (a few hundred bytes each)
_FIELDS = ("submission_id", "job_id", "status", "start_time", "end_time", "metadata", "type",
           "driver_node_id")  # where its log is: the goodput record is read from its last lines


def _trim(job: dict[str, Any]) -> dict[str, Any]:
    return {k: job.get(k) for k in _FIELDS}


class JobRecords:
    """One dashboard's job records, by submission id and by job id; thread-safe."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, dict[str, Any]] = OrderedDict()  # ended jobs, by both ids
        self._gone: dict[str, float] = {}
        self._lock = threading.Lock()

    def _known(self, ids: set[str], now: float) -> tuple[dict[str, dict[str, Any]], list[str]]:
        with self._lock:
            found = {i: self._kept[i] for i in ids if i in self._kept}
            unknown = sorted(i for i in ids if i not in found and self._gone.get(i, 0) < now)
        return found, unknown

    def _store(self, jobs: Iterable[dict[str, Any]], asked: Iterable[str], now: float) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        with self._lock:
            for job in map(_trim, jobs):
                for key in (job.get("submission_id"), job.get("job_id")):
                    if key:
                        found[key] = job
                        if job.get("status") in TERMINAL:
                            self._kept[key] = job
                            self._kept.move_to_end(key)
            while len(self._kept) > KEEP:
                self._kept.popitem(last=False)
            for i in asked:
                if i not in found:
                    self._gone[i] = now + GONE_S
        return found

    def find(self, client: Any, ids: Iterable[str]) -> list[dict[str, Any]]:
        """The records of `ids` (a sync Jobs client); ids Ray has no record of are left out."""
        now = time.monotonic()
        found, unknown = self._known(set(filter(None, ids)), now)
        if len(unknown) > LIST_ABOVE:
            fetched = client.get_json("/api/jobs/", {})
        else:
            fetched = [job for i in unknown if (job := _one(lambda i=i: client.get_json(_path(i), {})))]
        found |= self._store(fetched if isinstance(fetched, list) else [], unknown, now)
        return _unique(found.values())

    async def afind(self, client: Any, ids: Iterable[str]) -> list[dict[str, Any]]:
        """`find` for an async Jobs client: the GETs by id run concurrently."""
        now = time.monotonic()
        found, unknown = self._known(set(filter(None, ids)), now)
        if len(unknown) > LIST_ABOVE:
            fetched = await client.get_json("/api/jobs/", {})
        else:
            answers = await asyncio.gather(*(_aone(client.get_json(_path(i), {})) for i in unknown))
            fetched = [job for job in answers if job]
        found |= self._store(fetched if isinstance(fetched, list) else [], unknown, now)
        return _unique(found.values())


def _path(job: str) -> str:
    return f"/api/jobs/{quote(job, safe='')}"


def _one(call: Any) -> dict[str, Any] | None:
    try:
        job = call()
    except RaysliceError as exc:
        if getattr(exc, "status_code", None) == 404:
            return None  # deleted, or never a job
        raise
    return job if isinstance(job, dict) else None


async def _aone(call: Any) -> dict[str, Any] | None:
    try:
        job = await call
    except RaysliceError as exc:
        if getattr(exc, "status_code", None) == 404:
            return None
        raise
    return job if isinstance(job, dict) else None


def _unique(jobs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return list({id(j): j for j in jobs}.values())


_by_dashboard: dict[str, JobRecords] = {}
_lock = threading.Lock()


def records_for(address: str) -> JobRecords:
    """The process-wide records of the dashboard at `address` (every page and refresh shares them)."""
    with _lock:
        return _by_dashboard.setdefault(address, JobRecords())
