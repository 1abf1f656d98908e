"""The processes a local cluster or Airflow stack started, found and ended by PID (with psutil, no /proc parsing).

Why: `down`/`stop` must end exactly what `up`/`start` started, never another user's Ray or Airflow
on the same machine. Each node or component runs in its own process session
(`start_new_session`), which also holds every child it forks, so a session id names a whole tree.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

import psutil

__all__ = ["alive", "send_signal", "session_members"]


def alive(pid: int) -> bool:
    """Running, and not a zombie (an exited child its parent has not reaped yet)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def session_members(sessions: set[int], *, naming: str | None = None) -> set[int]:
    """Live processes in one of `sessions`, or whose command line contains `naming`; never this process."""
    members = set()
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) in sessions or (naming and naming in " ".join(proc.cmdline())):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    members.add(proc.pid)
        except (psutil.Error, OSError):
            continue  # gone meanwhile, or not ours to read
    members.discard(os.getpid())
    return members


def sessions_running(name: str) -> set[int]:
    """The sessions (by their leader's PID) that hold a live process called `name`."""
    sessions = set()
    for proc in psutil.process_iter(["name", "status"]):
        try:
            if proc.info["name"] == name and proc.info["status"] != psutil.STATUS_ZOMBIE:
                sessions.add(os.getsid(proc.pid))
        except (psutil.Error, OSError):
            continue  # gone meanwhile, or not ours to read
    return sessions


def send_signal(pid: int, sig: int) -> None:
    """`os.kill` that accepts a process that is already gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def environ_overlaid(env: Mapping[str, str]) -> Iterator[None]:
    """This process's environment with `env` over it inside the block, put back as it was afterwards.

    For what reads its settings from the environment only (Ray's GCS client's auth, a raylet started by
    a library call); not thread-safe, so callers that start nodes concurrently hold a lock around it.
    """
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
