"""What a running step knows about itself: `rayslice.get_step_context()`.

Named like Airflow's `get_current_context()` and Ray's `get_runtime_context()`. The launcher
sets it in each host process just before it calls the step, so a training function can find
its checkpoint folder and tell a first start from a resume without any argument plumbing.
Nothing here imports ray, jax or airflow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import re
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass

from rayslice.core import goodput
from rayslice.core.exceptions import RaysliceError
from rayslice.core.step import Owner

#: A command step's processes find their context in `RAYSLICE_<FIELD>` variables (`StepContext.to_env`).
ENV_PREFIX = "RAYSLICE_"
#: The file a command step's process may write its JSON result to (its host's XCom item).
RESULT_FILE_ENV = "RAYSLICE_RESULT_FILE"

#: A command step's processes: the file that holds the preemption notice (JSON) once one came; absent before.
NOTICE_FILE_ENV = "RAYSLICE_NOTICE_FILE"

#: The cluster-wide default root for checkpoint folders (`rayslice local up` sets it on every node).
CHECKPOINT_ROOT_ENV = "RAYSLICE_CHECKPOINT_ROOT"


@dataclass(frozen=True)
class StepContext:
    """The step's place in its Airflow task, its gang and its storage.

    - `try_number`: the Airflow try (0 for a step run outside Airflow).
    - `preemption_attempt`: 0 on the first gang, 1 after the first whole-gang retry, ...
    - `slice_index`, `slice_name`, `worker_id`: where this process runs (0, the request, 0 for a fraction).
    - `process_index`, `num_processes`: this process's JAX process id and its group's size.
    - `num_slices`: the slices this attempt runs on (an elastic step starts and resumes on what is free).
    - `checkpoint_dir`: a URL (`gs://…`, `s3://…`, `file://…`) that is the same for every preemption
      attempt and every Airflow try of this task in this DAG run and map index of this Airflow
      deployment, and different for any other; None when no checkpoint root is configured anywhere.
    """

    dag_id: str
    run_id: str
    task_id: str
    map_index: int
    try_number: int
    submission_id: str
    preemption_attempt: int
    slice_index: int
    slice_name: str
    worker_id: int
    process_index: int
    num_processes: int
    checkpoint_dir: str | None
    #: The slices this attempt runs on: an elastic step's (`num_slices=(min, max)`) may differ between attempts.
    num_slices: int = 1

    def to_env(self) -> dict[str, str]:
        """The context as a command step's environment: `RAYSLICE_<FIELD>` (checkpoint_dir empty when None)."""
        return {f"{ENV_PREFIX}{f.name.upper()}": "" if (value := getattr(self, f.name)) is None else str(value)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> StepContext | None:
        """The context a command step's process inherited (`to_env`), or None outside one."""
        if f"{ENV_PREFIX}SUBMISSION_ID" not in env:
            return None
        values = {}
        for f in dataclasses.fields(cls):
            raw = env.get(f"{ENV_PREFIX}{f.name.upper()}", "")
            default = 0 if f.default is dataclasses.MISSING else f.default
            values[f.name] = (int(raw) if raw else default) if f.type == "int" else \
                (raw or None if f.name == "checkpoint_dir" else raw)
        return cls(**values)

    def checkpointing(self) -> AbstractContextManager[None]:
        """Time a checkpoint save (or restore) as checkpointing, not productive time, in the step's goodput.

        `with get_step_context().checkpointing(): manager.save(step, ...)`: the launcher's goodput
        figures (`rayslice.core.goodput`) count the block apart from the step's productive time.
        """
        return goodput.span("checkpointing")

    def report_checkpoint(self, start: float, end: float) -> None:
        """Report a checkpoint that took `start`..`end` (epoch seconds, `time.time()`), e.g. an async save's."""
        goodput.report_span("checkpointing", start, end)

    @property
    def preemption_notice(self) -> PreemptionNotice | None:
        """The notice that this step's capacity is about to go, or None while none came.

        In a function step the launcher delivers it to this process; in a command step's
        processes it is read from `$RAYSLICE_NOTICE_FILE` (the program also got a signal).
        """
        if _notices.notice is not None:
            return _notices.notice
        path = os.environ.get(NOTICE_FILE_ENV)
        return PreemptionNotice.read(path) if path else None

    @property
    def preempted(self) -> bool:
        """True once a preemption notice came: checkpoint now, then raise `rayslice.StepSuspended` to be resumed.

        A step that returns instead has ended: its value is the step's result.
        """
        return self.preemption_notice is not None

    def on_preemption(self, callback: Callable[[PreemptionNotice], None]) -> None:
        """Call `callback(notice)` in a thread of rayslice's when a notice comes (at once if one came): once,
        or, for an elastic step, once for an offer to grow (`notice.grow`) and again for a real notice after it.

        Keep it short and thread-safe (set a flag your loop reads); the step itself decides when to
        checkpoint and stop. In a command step's processes the notice file is polled every 0.2 s.
        """
        _notices.register(callback, os.environ.get(NOTICE_FILE_ENV) if _current is None else None)

    @property
    def checkpoint_path(self) -> str | None:
        """`checkpoint_dir` as orbax (etils.epath) and most libraries take it: a plain path for `file://`."""
        return None if self.checkpoint_dir is None else as_path(self.checkpoint_dir)


def split_protocol(url: str) -> tuple[str | None, str]:
    """fsspec's own split of a URL into protocol and path, imported only when a URL is split.

    fsspec's import costs every process that imports rayslice (each step's host processes among
    them) about a tenth of a CPU-second, and only checkpoint folders need it.
    """
    from fsspec.core import split_protocol as split

    return split(url)


def as_path(url: str) -> str:
    """A storage URL as path-taking libraries (orbax, etils.epath) want it: `file://` URLs become plain paths."""
    protocol, path = split_protocol(url)
    return path if protocol in (None, "file", "local") else url


@dataclass(frozen=True)
class PreemptionNotice:
    """Why and by when the step's capacity goes: `deadline` in epoch seconds, `node` the drained Ray node."""

    deadline: float
    reason: str
    node: str = ""
    #: An elastic step's offer to grow: more slices are free. Nothing stops the step; it may checkpoint
    #: and raise `StepSuspended` to resume on more, or carry on (its result then stands).
    grow: bool = False

    @property
    def seconds_left(self) -> float:
        return max(0.0, self.deadline - time.time())

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> PreemptionNotice:
        data = json.loads(text)
        return cls(deadline=float(data["deadline"]), reason=str(data.get("reason", "")), node=str(data.get("node", "")),
                   grow=bool(data.get("grow", False)))

    @classmethod
    def read(cls, path: str) -> PreemptionNotice | None:
        """The notice in a command step's notice file, or None while there is none (or it is half-written)."""
        try:
            with open(path) as f:
                return cls.from_json(f.read())
        except (OSError, ValueError, KeyError):
            return None


class _Notices:
    """This process's notice and the callbacks waiting for it (the launcher delivers; the step polls or registers)."""

    def __init__(self) -> None:
        self.notice: PreemptionNotice | None = None
        self._callbacks: list[Callable[[PreemptionNotice], None]] = []
        self._lock = threading.Lock()

    def deliver(self, notice: PreemptionNotice) -> None:
        """The first notice stands, except an offer to grow: a real notice after it replaces it (callbacks again)."""
        with self._lock:
            current = self.notice
            if current is not None and not (current.grow and not notice.grow):
                return
            self.notice, callbacks = notice, list(self._callbacks)
        for callback in callbacks:
            _call(callback, notice)

    def withdraw_offer(self) -> None:
        """The queue took its offer to grow back (someone else took those slices): no notice stands now."""
        with self._lock:
            if self.notice is not None and self.notice.grow:
                self.notice = None

    def register(self, callback: Callable[[PreemptionNotice], None], notice_file: str | None) -> None:
        with self._lock:
            self._callbacks.append(callback)
            notice = self.notice
            if notice is None and notice_file and len(self._callbacks) == 1:
                threading.Thread(target=self._watch, args=(notice_file,), name="rayslice-notice-file",
                                 daemon=True).start()
        if notice is not None:
            _call(callback, notice)

    def _watch(self, path: str) -> None:
        while self.notice is None or self.notice.grow:
            if (notice := PreemptionNotice.read(path)) is not None and notice != self.notice:
                self.deliver(notice)
            time.sleep(0.2)

    def reset(self) -> None:
        with self._lock:
            self.notice, self._callbacks = None, []


def _call(callback: Callable[[PreemptionNotice], None], notice: PreemptionNotice) -> None:
    threading.Thread(target=callback, args=(notice,), name="rayslice-notice-callback", daemon=True).start()


_notices = _Notices()


def withdraw_offer() -> None:
    """The launcher's word that the queue took an offer to grow back (`_Notices.withdraw_offer`)."""
    _notices.withdraw_offer()


def deliver_notice(notice: PreemptionNotice) -> None:
    """The launcher's side: a preemption notice reached this host process (once; later ones are ignored)."""
    _notices.deliver(notice)


_current: StepContext | None = None


def get_step_context() -> StepContext:
    """The running step's context; only inside a step that rayslice launched (a function or a command)."""
    if _current is None and (inherited := StepContext.from_env(os.environ)) is not None:
        return inherited
    if _current is None:
        raise RaysliceError(
            "get_step_context() works only inside a step run by rayslice (an operator, a decorated task, "
            "run_step or run_step_job); call it from the step function, not at import time or in the DAG file"
        )
    return _current


def set_step_context(context: StepContext | None) -> None:
    """The launcher's side: called in each host process before the step, with None after it."""
    global _current
    _current = context
    _notices.reset()  # a notice belongs to one step run: the next step in this process starts without one


def checkpoint_dir_for(root: str | None, owner: Owner) -> str | None:
    """`<root>/<deployment>/<dag>/<run>/<task>[/map-<i>]`: one folder per task of a run, shared by its tries.

    The Airflow deployment (`Owner.deployment`) comes first: another Airflow on the same cluster
    with the same DAG, run id and task gets a folder of its own.

    A DAG run deleted and created again under the same run_id gets the same folder: a scheduled
    run that is re-created resumes from its predecessor's checkpoints (delete the folder for a
    fresh start). A step outside Airflow gets a folder of its own submission id.
    """
    if not root:
        return None
    protocol, path = split_protocol(root)
    if owner.dag_id:
        parts = [*([owner.deployment] if owner.deployment else []), owner.dag_id, owner.run_id, owner.task_id]
        if owner.map_index >= 0:
            parts.append(f"map-{owner.map_index}")
    else:
        parts = ["adhoc", owner.submission_id or "unnamed"]
    joined = posixpath.join(path.rstrip("/") or "/", *(_component(p) for p in parts))
    return f"{protocol or 'file'}://{joined}"


def _component(value: str) -> str:
    """One safe path component; run ids carry ':' and '+' (`scheduled__2026-01-01T00:00:00+00:00`).

    A value that had to be changed gets a short hash of the original, so two ids never share a folder.
    """
    safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", value).strip(".")
    if safe == value and safe:
        return safe
    return f"{safe or '_'}-{hashlib.sha1(value.encode()).hexdigest()[:8]}"
