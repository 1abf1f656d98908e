"""Make resuming visible: before each attempt, say what the step's checkpoint folder already holds.

The launcher does not read or write checkpoints itself (the step does, e.g. with orbax); it
keeps a small attempt record in the folder (`_rayslice_attempts.jsonl`: try, preemption attempt,
start time) so that the newest checkpoint can be traced to the try that wrote it. Step folders
are the entries named by a whole number (orbax's layout, and most others'); unfinished ones
(orbax's `<step>.orbax-checkpoint-tmp-*`) are not counted.
"""

from __future__ import annotations

import json
import posixpath
import time
from datetime import UTC, datetime

ATTEMPTS_FILE = "_rayslice_attempts.jsonl"


def _filesystem(checkpoint_dir: str):
    """fsspec's filesystem and path for `checkpoint_dir`; imported here, not at the top: only a step with a
    checkpoint folder pays for fsspec's import."""
    import fsspec

    return fsspec.core.url_to_fs(checkpoint_dir)


def describe_and_record(checkpoint_dir: str, *, try_number: int, preemption_attempt: int, submission_id: str) -> str:
    """One log line on what `checkpoint_dir` holds; appends this attempt to its record. Never raises."""
    try:
        fs, root = _filesystem(checkpoint_dir)
        fs.makedirs(root, exist_ok=True)
        attempts = _attempts(fs, root)
        steps = sorted(
            (int(posixpath.basename(entry["name"].rstrip("/"))), entry)
            for entry in fs.ls(root, detail=True)
            if posixpath.basename(entry["name"].rstrip("/")).isdigit()
        )
        record = {"try_number": try_number, "preemption_attempt": preemption_attempt,
                  "submission_id": submission_id, "started": time.time()}
        with fs.open(posixpath.join(root, ATTEMPTS_FILE), "a") as out:
            out.write(json.dumps(record) + "\n")
    except Exception as exc:  # storage trouble must not fail the step before it starts; the step will see it
        return f"could not look into checkpoint_dir {checkpoint_dir}: {type(exc).__name__}: {exc}"
    if not steps:
        return f"checkpoint_dir {checkpoint_dir} holds no checkpoint: the step starts fresh"
    newest, entry = steps[-1]
    written = _mtime(fs, entry)
    by = _writer(attempts, written)
    when = datetime.fromtimestamp(written, UTC).isoformat(timespec="seconds") if written else "at an unknown time"
    return (f"resuming: checkpoint_dir {checkpoint_dir} holds checkpoints of step(s) "
            f"{', '.join(str(step) for step, _ in steps[-5:])}; the newest, step {newest}, was written {when}"
            f"{f' by {by}' if by else ''}")


def newest_written(checkpoint_dir: str) -> float | None:
    """When the newest complete step folder was last written (None: no step folder, or unreadable). Never raises.

    After a preemption this is where the lost work starts: the resume redoes everything after it.
    """
    try:
        fs, root = _filesystem(checkpoint_dir)
        steps = sorted((int(posixpath.basename(entry["name"].rstrip("/"))), entry)
                       for entry in fs.ls(root, detail=True)
                       if posixpath.basename(entry["name"].rstrip("/")).isdigit())
    except Exception:
        return None
    return _mtime(fs, steps[-1][1]) if steps else None


def _attempts(fs, root: str) -> list[dict]:
    path = posixpath.join(root, ATTEMPTS_FILE)
    if not fs.exists(path):
        return []
    with fs.open(path, "r") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def _mtime(fs, entry: dict) -> float | None:
    """The newest modification time under a step folder (a folder's own time may be its creation)."""
    try:
        times = [info.get("mtime") or info.get("created") for info in fs.find(entry["name"], detail=True).values()]
        times = [t.timestamp() if isinstance(t, datetime) else float(t) for t in times if t]
        return max(times) if times else None
    except Exception:
        return None


def _writer(attempts: list[dict], written: float | None) -> str | None:
    """The attempt that started last before the checkpoint was written."""
    if written is None:
        return None
    before = [a for a in attempts if a.get("started", 0) <= written]
    if not before:
        return None
    last = before[-1]
    who = f"try {last['try_number']}, preemption attempt {last['preemption_attempt']}"
    return f"{who} (Ray job {last['submission_id']})" if last.get("submission_id") else who


def complete_steps(checkpoint_dir: str) -> list[int]:
    """The whole-numbered (complete) step folders in `checkpoint_dir`, oldest first; [] when unreadable."""
    try:
        fs, root = _filesystem(checkpoint_dir)
        return sorted(int(name) for entry in fs.ls(root, detail=False)
                      if (name := posixpath.basename(str(entry).rstrip("/"))).isdigit())
    except Exception:
        return []
