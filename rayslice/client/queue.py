"""`rayslice queue`: the cluster's admission queue, read over the Jobs API (no `ray` on this side).

The queue lives in the cluster's broker actor, which only a Ray driver can ask; so a short Ray job
(`python -m rayslice.cluster.queue`, the launcher's own code) prints it as one marked JSON line.
"""

from __future__ import annotations

import json
import secrets
import shlex
import time
from typing import Any

from rayslice.client.jobs_client import RayJobsClient
from rayslice.client.submission import launcher_packages
from rayslice.core.exceptions import RayJobsError
from rayslice.core.queue import QueueSettings

#: The line the queue job prints its snapshot on.
MARKER = "::rayslice-queue::"
ENTRYPOINT = "python -m rayslice.cluster.queue"


def read_queue(client: RayJobsClient, *, installed: bool = False, timeout: float = 120.0,
               set_settings: QueueSettings | None = None) -> dict[str, Any]:
    """The queue's snapshot: `entries` (running first, then waiting in order) and `settings`.

    `set_settings`: the operator's new policy and quotas, set first. Only someone who may submit Ray jobs
    (the cluster's token) can; the broker keeps them in the GCS, so a new broker reads them too.
    """
    entrypoint = ENTRYPOINT
    if set_settings is not None:
        entrypoint += f" --set {shlex.quote(set_settings.model_dump_json())}"
    runtime_env: dict[str, Any] = {}
    if not installed:
        runtime_env["py_modules"] = [client.ensure_package(package) for package in launcher_packages()]
    sid = f"rayslice-queue-{secrets.token_hex(6)}"
    client.submit(entrypoint, submission_id=sid, runtime_env=runtime_env or None,
                  metadata={"rayslice-queue": "1"})
    deadline = time.monotonic() + timeout
    while not (job := client.get(sid)).status.is_terminal:
        if time.monotonic() > deadline:
            client.stop(sid)
            raise RayJobsError(f"the queue job {sid} did not finish within {timeout:g} s")
        time.sleep(0.2)
    log = client.logs(sid)
    for line in reversed(log.splitlines()):
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    raise RayJobsError(f"the queue job {sid} ended {job.status.value} without the queue: {log[-500:]}")
