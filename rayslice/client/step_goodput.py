"""Each ended step's goodput figures, read back from the last lines of its Ray job's log.

The launcher ends a step's job log with its goodput record (`rayslice.core.goodput`, the line
`[rayslice] goodput-record: {...}`, just before the result line). Ray keeps no other store that
holds it, so the usage table reads it where it is: a bounded read of the job log's last lines
(`RayJobsClient.log_lines`, the state API), once per ended job, kept afterwards (an ended job's
log never changes). Running jobs have no record yet. A job whose record cannot be read (a log
Ray has rotated away, a step of an older rayslice) shows without figures, never as zero.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from rayslice.client.job_records import TERMINAL
from rayslice.client.jobs_client import JobDetails
from rayslice.core.exceptions import RaysliceError
from rayslice.core.goodput import Account, parse_record

__all__ = ["find", "afind"]

TAIL_LINES = 60  # the record is the last line but one; a few hosts' late lines may follow it
READS_PER_CALL = 64  # new reads per refresh, so a first look at a busy week is spread over refreshes
CONCURRENT_READS = 8
KEEP = 100_000

_kept: dict[str, OrderedDict[str, dict[str, Any] | None]] = {}
_lock = threading.Lock()


def _cache(address: str) -> OrderedDict[str, dict[str, Any] | None]:
    with _lock:
        return _kept.setdefault(address, OrderedDict())


def _to_read(address: str, jobs: Iterable[dict[str, Any]]) -> tuple[dict[str, Account], list[dict[str, Any]]]:
    cache = _cache(address)
    found: dict[str, Account] = {}
    unread = []
    for job in jobs:
        sid = job.get("submission_id")
        if not sid or job.get("status") not in TERMINAL:
            continue
        with _lock:
            known = sid in cache
            value = cache.get(sid)
        if known:
            if value is not None:
                found[sid] = Account.from_json(value)
        elif job.get("driver_node_id"):
            unread.append(job)
    return found, unread[:READS_PER_CALL]


def _keep(address: str, sid: str, account: Account | None) -> None:
    cache = _cache(address)
    with _lock:
        cache[sid] = None if account is None else account.to_json()
        while len(cache) > KEEP:
            cache.popitem(last=False)


def find(client: Any, jobs: Iterable[dict[str, Any]]) -> dict[str, Account]:
    """Submission id -> figures of the ended jobs among `jobs` (records as `job_records` keeps them)."""
    found, unread = _to_read(client.address, jobs)
    for job in unread:
        try:
            log = client.log_lines(JobDetails.model_validate(job), TAIL_LINES)
        except (RaysliceError, ValueError):
            continue  # read again on the next refresh
        account = parse_record(log)
        _keep(client.address, job["submission_id"], account)
        if account is not None:
            found[job["submission_id"]] = account
    return found


async def afind(client: Any, jobs: Iterable[dict[str, Any]]) -> dict[str, Account]:
    """`find` for an async Jobs client: up to CONCURRENT_READS reads at once."""
    found, unread = _to_read(client.address, jobs)
    gate = asyncio.Semaphore(CONCURRENT_READS)

    async def read(job: dict[str, Any]) -> None:
        async with gate:
            try:
                log = await client.log_lines(JobDetails.model_validate(job), TAIL_LINES)
            except (RaysliceError, ValueError):
                return
        account = parse_record(log)
        _keep(client.address, job["submission_id"], account)
        if account is not None:
            found[job["submission_id"]] = account

    await asyncio.gather(*(read(job) for job in unread))
    return found
