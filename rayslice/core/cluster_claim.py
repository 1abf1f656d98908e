"""Which cluster of a set runs a step now: a chain of create-if-absent claims in the step's shared folder.

A step that names several Ray clusters (`ClusterSet`) is submitted to each of them at once, and each
launcher waits in its own cluster's admission queue. Timing must never decide which of them runs the
body: two clusters may admit the step within the same millisecond, and neither can see the other's
queue. So the launcher that is admitted first *claims* the step before any host starts, by creating
a file that must not exist yet, in the step's checkpoint folder, which every cluster of the set can
read (`gs://` in production, one shared folder for the local clusters):

    <checkpoint_dir>/.rayslice-claims/<submission id>/claim-<g>.json     the holder of generation g
    <checkpoint_dir>/.rayslice-claims/<submission id>/released-<g>.json  g's holder stopped (every host ended)
    <checkpoint_dir>/.rayslice-claims/<submission id>/done.json          the step ended; nobody runs it again

Generation g is free once every generation before it was released. Exactly one launcher creates
`claim-g` (the filesystem's exclusive create: a hard link of the writer's own file locally, so a claim
is never seen half-written; fsspec's `open(mode="xb")`, a generation-match precondition, on object
stores), and the others see it and stand by, out of their queues.
The holder writes `released-g` only after its hosts ended (a suspension, a lost slice), so the next
generation, on whichever cluster admits the step next, never runs beside it; `done` ends the standbys.

Each submission is its own chain: its id names the Airflow try and the task instance, so a retry, or a
run deleted and created again under the same run id (which shares the checkpoint folder on purpose), never
reads an earlier chain's `done`. Listings are read past any cache (`refresh=True`: gcsfs keeps them forever
by default, and a waiting cluster would never see a release). Pure fsspec: the launcher takes and releases
claims; the Airflow side only reads them.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rayslice.core.exceptions import InvalidRequestError

CLAIMS_FOLDER = ".rayslice-claims"
#: A member cluster's name: a `ray` connection id, or a local cluster's name.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class ClusterSet(BaseModel):
    """What a step's launcher on one cluster of a set knows of the set (`StepSpec.cluster_set`).

    `members` in order of preference (the first wins a tie); `member`: the cluster this job runs on;
    `arrival`: the step's arrival (the submitter's clock), the same in every cluster's queue, so it waits
    in each at one place and resumes at it after a suspension.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(..., pattern=NAME_PATTERN, description="the set's name (its connection id)")
    members: tuple[str, ...] = Field(..., min_length=2)
    member: str = Field("", description="this job's cluster; empty until the submitter picks it")
    arrival: float = Field(0.0, ge=0)

    @field_validator("members")
    @classmethod
    def _distinct(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [name for name in value if not re.fullmatch(NAME_PATTERN, name)]
        if bad:
            raise ValueError(f"cluster names must be 1-64 letters, digits, '.', '_' or '-', got {bad}")
        if len(set(value)) != len(value):
            raise ValueError(f"a cluster set names each cluster once, got {list(value)}")
        return value

    @property
    def rank(self) -> int:
        """This job's cluster's place in the preference order (0: the first choice)."""
        return self.members.index(self.member) if self.member in self.members else len(self.members)


@dataclass(frozen=True)
class ClaimState:
    """What the claims folder says now."""

    generation: int  # the generation in play: the first one not released
    holder: dict[str, Any] | None  # its claim, if somebody holds it
    done: dict[str, Any] | None  # the step's end, once written

    def held_by(self, member: str, submission_id: str) -> bool:
        return bool(self.holder) and self.holder.get("cluster") == member \
            and self.holder.get("submission_id") == submission_id


class Claims:
    """The claims of one submission of a step (`folder`: `<checkpoint_dir>/.rayslice-claims/<submission id>`)."""

    def __init__(self, checkpoint_dir: str, *, member: str, submission_id: str) -> None:
        import fsspec  # here: every host process imports core/step.py, and most never touch storage

        self.folder = posixpath.join(checkpoint_dir.rstrip("/"), CLAIMS_FOLDER, submission_id)
        self.fs, self._root = fsspec.core.url_to_fs(self.folder)
        self.member, self.submission_id = member, submission_id

    def _path(self, name: str) -> str:
        return posixpath.join(self._root, name)

    def _read(self, name: str) -> dict[str, Any] | None:
        try:
            with self.fs.open(self._path(name), "rb") as f:
                record = json.loads(f.read())
        except FileNotFoundError:
            return None
        except ValueError:  # a claim being written (object stores write whole objects; a local file may be short)
            return {"cluster": "?", "partial": True}
        return record if isinstance(record, dict) else {"cluster": "?", "partial": True}

    def state(self) -> ClaimState:
        """Where the chain stands (a listing and at most two reads)."""
        try:
            names = {posixpath.basename(p) for p in self.fs.ls(self._root, detail=False, refresh=True)}
        except FileNotFoundError:
            names = set()
        generation = 0
        while f"released-{generation}.json" in names:
            generation += 1
        holder = self._read(f"claim-{generation}.json") if f"claim-{generation}.json" in names else None
        done = self._read("done.json") if "done.json" in names else None
        return ClaimState(generation, holder, done)

    def _record(self, **more: Any) -> bytes:
        return json.dumps({"cluster": self.member, "submission_id": self.submission_id, "at": time.time(),
                           **more}).encode()

    def take(self) -> ClaimState:
        """Claim the generation in play for this cluster, if it is free; the state after (held by whom).

        Safe to call again: a claim already this job's is kept. Raises InvalidRequestError if the
        filesystem cannot create exclusively (then no two clusters could be kept apart).
        """
        now = self.state()
        if now.done is not None or now.holder is not None:
            return now
        self.fs.makedirs(self._root, exist_ok=True)
        try:
            self._create_whole(f"claim-{now.generation}.json", self._record(generation=now.generation))
        except FileExistsError:
            pass  # somebody else was first: state() says who
        except (NotImplementedError, ValueError) as exc:
            raise InvalidRequestError(
                f"the checkpoint folder {self.folder} is on a filesystem that cannot create a file only if it is "
                f"absent ({type(exc).__name__}: {exc}); a step on several clusters needs that to run on one at a "
                "time: use gs://, or a folder every cluster mounts") from exc
        return self.state()

    def _create_whole(self, name: str, data: bytes) -> None:
        """Create `name` with `data` if it does not exist (FileExistsError if it does), never seen half-written.

        An object store writes a whole object, under a does-not-exist precondition. A local or mounted folder
        would show the file between its exclusive create and its write (a writer frozen there, or failing
        halfway, would leave a claim nobody can read): there the data goes to a file of the writer's own
        first, and a hard link, which fails if the name exists, creates the claim whole (the lock-file way,
        safe on NFS too).
        """
        from fsspec.implementations.local import LocalFileSystem

        if not isinstance(self.fs, LocalFileSystem):
            with self.fs.open(self._path(name), "xb") as f:
                f.write(data)
            return
        own = self._path(f".{name}.{self.member or 'x'}.{secrets.token_hex(6)}.tmp")
        try:
            with open(own, "wb") as f:
                f.write(data)
            try:
                os.link(own, self._path(name))
            except FileExistsError:
                raise
            except OSError:  # a mount without hard links (a FUSE one): the exclusive create, then the write
                with open(self._path(name), "xb") as f:
                    f.write(data)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(own)

    def note_admitted(self, generation: int) -> None:
        """This cluster's queue admitted the step for `generation` (it reserves now): later clusters of the set
        then give it its preference before they claim (`admitted`). A plain write: only a hint, never a claim."""
        self.fs.makedirs(self._root, exist_ok=True)
        with self.fs.open(self._path(f"admitted-{generation}-{self.member}.json"), "wb") as f:
            f.write(self._record(generation=generation))

    def admitted(self, generation: int) -> set[str]:
        """The clusters whose queues said they admitted the step for `generation` (`note_admitted`)."""
        try:
            names = [posixpath.basename(p) for p in self.fs.ls(self._root, detail=False, refresh=True)]
        except FileNotFoundError:
            return set()
        prefix = f"admitted-{generation}-"
        return {name[len(prefix):-len(".json")] for name in names if name.startswith(prefix) and name.endswith(".json")}

    def release(self, generation: int, why: str, retries_used: int = 0) -> None:
        """This job's hosts ended and the step resumes: the next generation is anybody's.

        `retries_used`: the step's preemption retries used so far on every cluster of the set, this
        suspension's included; the next holder reads it (`retries_before`), so the set counts them once.
        """
        self._write(f"released-{generation}.json",
                    self._record(generation=generation, why=why, retries_used=retries_used))

    def retries_before(self, generation: int) -> int:
        """The preemption retries the step had used on any cluster of the set before `generation` was claimed."""
        for earlier in range(generation - 1, -1, -1):  # the last release (a void claim has none)
            record = self._read(f"released-{earlier}.json")
            if record is None:
                continue
            try:
                return max(0, int(record.get("retries_used", 0)))
            except (TypeError, ValueError):
                return 0
        return 0

    def finish(self, outcome: str) -> None:
        """The step ended here (succeeded, failed, stopped): every standby job ends too."""
        self._write("done.json", self._record(outcome=outcome))

    def _write(self, name: str, data: bytes) -> None:
        self.fs.makedirs(self._root, exist_ok=True)
        try:
            self._create_whole(name, data)
        except FileExistsError:
            pass  # written before (a repeated call): the first word stands


def end_chain(checkpoint_dir: str, submission_id: str, outcome: str, **more: Any) -> bool:
    """Write the chain's `done` from outside its clusters (Airflow: the task killed, a later try); False if it had
    ended already. A job of the step still waiting in some cluster's queue then ends when admitted there."""
    chain = Claims(checkpoint_dir, member="", submission_id=submission_id)
    if chain.state().done is not None:
        return False
    chain._write("done.json", chain._record(outcome=outcome, **more))
    return True


def end_other_chains(checkpoint_dir: str, keep: str, outcome: str,
                     unreachable: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Write `done` into every chain of the step's folder but `keep`'s (a retry's own); the ids it ended.

    An Airflow retry stops the earlier try's jobs on every cluster it reaches; an earlier try's job on a
    cluster it cannot reach (a partition) may still wait in that cluster's queue. With its chain ended,
    that job stands by and ends when it is admitted, instead of running beside the retry. A chain whose
    step is held now by a cluster in `unreachable` may still run there: InvalidRequestError, nothing ended
    (the retry must not start beside it).
    """
    import fsspec

    fs, root = fsspec.core.url_to_fs(posixpath.join(checkpoint_dir.rstrip("/"), CLAIMS_FOLDER))
    try:
        chains = sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False, refresh=True))
    except FileNotFoundError:
        return []
    def check(sid: str, state: ClaimState) -> None:
        holder = may_still_run(state)
        if holder in unreachable:
            raise InvalidRequestError(
                f"an earlier try's Ray job {sid} holds the step on cluster {holder}, which cannot be reached: it may "
                f"still run there, so this try does not start beside it; retry once {holder} answers (or, once you "
                f"know that job is gone, delete {posixpath.join(checkpoint_dir, CLAIMS_FOLDER, sid)})")

    others = [sid for sid in chains if sid != keep]
    for sid in others:
        check(sid, Claims(checkpoint_dir, member="", submission_id=sid).state())
    ended = [sid for sid in others if end_chain(checkpoint_dir, sid, outcome, superseded_by=keep)]
    for sid in others:  # a job that claimed between the look above and the end: it read no `done` (it runs)
        check(sid, Claims(checkpoint_dir, member="", submission_id=sid).state())
    return ended


def may_still_run(state: ClaimState) -> str | None:
    """The cluster whose job may still run the step by this chain: the generation's holder, unless the holder
    itself wrote the end (a `done` from Airflow, for a kill or a later try, stops no job that already runs)."""
    holder = (state.holder or {}).get("cluster")
    if not holder or (state.done is not None and state.done.get("cluster")):
        return None
    return holder


def check_shared_root(root: str | None, what: str) -> None:
    """A step on several clusters keeps its checkpoints (and claims) where every cluster reads them.

    A `file://` root or a bare path is one machine's, unless every cluster mounts it: the set must
    say so (`shared_root: true` on a set of local clusters, or an NFS / Filestore mount).
    """
    if not root:
        raise InvalidRequestError(
            f"{what}: a step on several clusters needs a checkpoint root every cluster can read (its claims "
            "and checkpoints live there), e.g. 'gs://bucket/ckpt'; none is set: give the step checkpoint_root= or "
            "the cluster set's connection the extra 'checkpoint_root'")
    target = root.rsplit("::", 1)[-1]  # a chained URL (`simplecache::file://...`) stores where its last part says
    protocol = target.split("://", 1)[0] if "://" in target else "file"
    if protocol in ("file", "local", "memory"):
        raise InvalidRequestError(
            f"{what}: checkpoint root {root!r} is on one machine's disk, which the other clusters of the set "
            "cannot read: use a shared store (e.g. 'gs://bucket/ckpt'), or, for a folder every cluster mounts "
            "(the local clusters, NFS), set the cluster set's extra 'shared_root': true")
