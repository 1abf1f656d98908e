"""The Jobs API's record of one Ray job, read straight from the GCS (no dashboard round trip).

Both the reaper (has the job that made a group ended?) and the phase lines (when did Ray accept this
job?) need it; it lives apart from both so neither imports the other.
"""

from __future__ import annotations

import json

import ray


def job_status(sid: str) -> str | None:
    """The Jobs API status of submission `sid`, read from the GCS; None when no such job was submitted."""
    info = job_info(sid)
    return None if info is None else str(info.get("status"))


def job_info(sid: str) -> dict | None:
    """The Jobs API record of submission `sid` (status, start_time, ...) from the GCS; None when there is none."""
    from ray._private import ray_constants
    from ray.dashboard.modules.job.common import JobInfoStorageClient

    key = JobInfoStorageClient.JOB_DATA_KEY.format(job_id=sid).encode()
    gcs = ray._private.worker.global_worker.gcs_client
    namespace = ray_constants.KV_NAMESPACE_JOB
    raw = gcs.internal_kv_get(key, namespace.encode() if isinstance(namespace, str) else namespace)
    return None if raw is None else json.loads(raw)
