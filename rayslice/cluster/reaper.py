"""Free what a finished rayslice job left reserved: placement groups and actors named `rayslice:<sid>...`.

Measured on the local cluster (Ray 2.60): when a job's driver is SIGKILLed, or its job supervisor
is, Ray itself removes the driver's placement groups and actors within about a second (they are
not detached). So this sweep is a safety net for what outlives its job anyway: detached or leaked
groups, or a GCS that has not caught up. The common orphan, a job that keeps running after its
Airflow worker died, is stopped from the Airflow side (`rayslice.client.orphans`), whose end frees it.

The rule is narrow on purpose: only names starting `rayslice:`, and only when the Ray job that
*created* the group or actor (its driver, as the GCS records it) has ended. The name is never trusted
to say whose it is: a submission id may hold a `/`, and a hand re-run of an old `spec.json` names its
reservation after a job that ended long ago while it is itself alive.

Keys in Ray's KV belong to no job, so Ray never ends them: each step's start also forgets the hosts'
phase keys (`forget_ended_phases`) of steps whose Ray job has ended.

`python -m rayslice.cluster.reaper [--dry-run]` runs the sweep as a Ray job (see `rayslice reap`).
"""

from __future__ import annotations

import re
import sys
from dataclasses import asdict, dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup

from rayslice.cluster.ray_jobs import job_info, job_status  # noqa: F401  (job_info: where callers found it)

PREFIX = "rayslice:"


@dataclass(frozen=True)
class Orphan:
    kind: str  # "placement_group" or "actor"
    name: str
    submission_id: str
    job_status: str
    id: str = ""  # the group's or actor's id (hex): what is removed, never the name (names repeat)
    namespace: str = ""  # an actor's


def submission_id_of(name: str) -> str | None:
    """`rayslice:<sid>[/heads|/hosts|/slice/hostN]` -> `<sid>`; None for other names."""
    if not name.startswith(PREFIX):
        return None
    sid = name[len(PREFIX) :].split("/", 1)[0]
    return sid or None


def find_orphans(exclude: str | None = None) -> list[Orphan]:
    """Named groups and actors whose creating driver has ended. Cheap: the GCS's job and group tables."""
    from ray.core.generated import gcs_pb2

    gcs = ray._private.state.state
    ended = {job["JobID"] for job in gcs.job_table() if job["IsDead"]}
    found: list[tuple[str, str, str, str]] = []  # (name, kind, id, namespace)
    for raw in gcs._connect_and_get_accessor().get_placement_group_table():
        group = gcs_pb2.PlacementGroupTableData.FromString(raw)
        removed = group.state == gcs_pb2.PlacementGroupTableData.REMOVED
        if group.name.startswith(PREFIX) and not removed and (
                group.creator_job_dead or group.creator_job_id.hex() in ended):
            found.append((group.name, "placement_group", group.placement_group_id.hex(), ""))
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(PREFIX):
            handle = _handle(actor["name"], actor["namespace"])
            if handle is not None and handle._actor_id.job_id.hex() in ended:
                found.append((actor["name"], "actor", handle._actor_id.hex(), actor["namespace"]))
    statuses: dict[str, str | None] = {}
    orphans = []
    for name, kind, id, namespace in found:
        sid = submission_id_of(name) or ""
        if exclude and sid == exclude:
            continue
        if sid not in statuses:
            statuses[sid] = job_status(sid) if sid else None
        orphans.append(Orphan(kind=kind, name=name, submission_id=sid,
                              job_status=statuses[sid] or "ended (its driver exited)", id=id, namespace=namespace))
    return orphans


def _handle(name: str, namespace: str) -> Any:
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:  # gone since it was listed
        return None


def reap(*, dry_run: bool = False, exclude: str | None = None) -> list[Orphan]:
    """Remove the orphans' placement groups and kill their actors; returns what was (or would be) reaped.

    `exclude`: a submission id whose leftovers stay (the calling step's own; they have a live creator anyway).
    """
    orphans = find_orphans(exclude)
    if dry_run:
        return orphans
    for orphan in orphans:
        try:
            if orphan.kind == "actor":  # by id: the name may since be a live actor's, made anew
                handle = _handle(orphan.name, orphan.namespace)
                if handle is not None and handle._actor_id.hex() == orphan.id:
                    ray.kill(handle, no_restart=True)
            else:
                ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(orphan.id))))
        except ValueError:  # gone between listing and reaping
            pass
    return orphans


#: A phase key: `phases:<sid>:<attempt>:<8 hex>:<label>` (cluster/phases.py `attempt_key`); the sid may hold `:`.
_PHASE_KEY = re.compile(r"^(?P<sid>.+?):\d+:[0-9a-f]{8}:")
ENDED = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})


def forget_ended_phases(exclude: str | None = None) -> int:
    """Forget the hosts' phase keys (cluster/phases.py) of jobs that ended; how many were forgotten.

    Ray's KV belongs to no job: a driver killed before it forgot its keys leaves them forever, where
    Ray itself ends its groups and actors. Keys of a live job, of no known job, and of `exclude` stay.
    """
    from ray.experimental import internal_kv

    from rayslice.cluster import phases

    statuses: dict[str, str | None] = {}
    forgotten = 0
    for raw in internal_kv._internal_kv_list(phases.KEY_PREFIX, namespace=phases.NAMESPACE):
        key = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        found = _PHASE_KEY.match(key[len(phases.KEY_PREFIX):])
        sid = found["sid"] if found else None
        if not sid or sid == exclude:
            continue
        if sid not in statuses:
            statuses[sid] = job_status(sid)
        if statuses[sid] in ENDED:
            internal_kv._internal_kv_del(raw, namespace=phases.NAMESPACE)
            forgotten += 1
    return forgotten


def main(argv: list[str]) -> int:
    from rayslice.core.step import format_result

    ray.init(address="auto", logging_level="WARNING")
    reaped = reap(dry_run="--dry-run" in argv)
    for orphan in reaped:
        print(f"[rayslice] {'would reap' if '--dry-run' in argv else 'reaped'} {orphan.kind} {orphan.name} "
              f"(job {orphan.submission_id} is {orphan.job_status})", flush=True)
    print(format_result([asdict(o) for o in reaped]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
