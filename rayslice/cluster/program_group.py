"""Ending every process of a command step's program: its process group, and those that left it.

The program runs in its own session, so its group holds whatever it started (`tensorboard &`, a
log shipper); a child that starts a session of its own (`setsid`, `start_new_session=True`)
leaves the group but keeps the program's environment, which carries a marker unique to this run
(`RAYSLICE_PROGRAM_REPORT=<this run's folder>`): every process on this host whose environment
holds it is ended too.

Stdlib only: the host actor imports it, and its guard runs it as a script (`python -S -E
program_group.py MARKER`): the guard reads its stdin, a pipe only the host actor holds, and ends the
program once that reaches its end, that is once the host actor died (`ray.kill`, SIGKILL). The host
writes `group PGID` once the program runs, and `done` once it has ended the program itself (the guard
then stands down: the group's id may be reused by then).

The guard is nobody's child: it forks and its first process exits at once. A dying Ray worker kills
its own children as it exits (`RAY_kill_child_processes_on_worker_exit`, on by default), before its
pipes close, so a guard that was the worker's child died before it could act, and a backgrounded child
of the program (forked, not exec'd: no parent-death signal) outlived the step.
"""

from __future__ import annotations

import os
import signal
import sys
import time

#: How long the ending goes on looking for processes that a dying one has just started.
SETTLE_S = 2.0


def end(pgid: int | None, marker: bytes, within: float = SETTLE_S, started: int | None = None) -> None:
    """Kill the program's group (if known), then every process that still carries the marker, until none is left.

    `started` is the group leader's start time (`start_time`, read while it ran): once the program's
    group emptied, its number may lead another session (pid_max is 32768 on many hosts), and that
    group is not the program's to kill. A number still used by a group of the program cannot be reused.
    Start times count clock ticks (10 ms): a number back inside its first owner's tick would pass for it,
    but that takes pid_max forks within the tick.
    """
    if pgid is not None and not _reused(pgid, started):
        _kill_group(pgid)
    deadline = time.monotonic() + within
    while True:
        left = marked(marker)
        if not left or time.monotonic() > deadline:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)


def marked(marker: bytes) -> list[int]:
    """This user's live processes (zombies are ended) whose environment holds `marker` (`NAME=value`)."""
    me, found = os.getpid(), []
    try:
        names = os.listdir("/proc")
    except OSError:  # not Linux: the group alone
        return []
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
        except OSError:  # gone, or not ours to read
            continue
        found.append(int(name))
    return found


def start_time(pid: int) -> int | None:
    """When the process `pid` started (clock ticks since boot, /proc/PID/stat's 22nd field); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _reused(pgid: int, started: int | None) -> bool:
    """Whether the number `pgid` now names another process than the program's leader that started at `started`."""
    if started is None:
        return False
    now = start_time(pgid)
    return now is not None and now != started


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:  # the group is already empty
        pass


#: What the host writes to its guard: the program's group once it runs (`group PGID START`, START its
#: leader's `start_time`), and that it ended the program itself (`done`).
GROUP, DONE = b"group ", b"done"


def group_word(pgid: int, started: int | None) -> bytes:
    """The host's word for its guard once the program runs (`started`: read while the leader was not reaped)."""
    return GROUP + f"{pgid} {started or 0}".encode()


def guard(marker: bytes) -> None:
    """The guard's body: detach from the host actor's process tree, then wait for the host's word or its death."""
    if os.fork() > 0:
        os._exit(0)  # the host reaps this first process at once; the guard lives on, reparented
    pgid, started = None, None
    for line in sys.stdin.buffer:  # until the pipe's end: the host closed it, or died
        if line.startswith(GROUP):
            number, _, when = line[len(GROUP):].strip().partition(b" ")
            pgid, started = int(number), (int(when) or None) if when else None
        elif line.strip() == DONE:
            return  # the host ended the program itself: stand down at once
    end(pgid, marker, started=started)


if __name__ == "__main__":
    guard(os.fsencode(sys.argv[1]))
