"""Ending every process of a command step's program: its process group, and those that left it.

The program runs in its own session, so its group holds whatever it started (`tensorboard &`, a
log shipper); a child that starts a session of its own (`setsid`, `start_new_session=True`)
leaves the group but keeps the program's environment, which carries a marker unique to this run
(`RAYSLICE_PROGRAM_REPORT=<this run's folder>`): every process on this host whose environment
holds it is ended too.

Stdlib only: the host actor imports it, and its guard runs it as a script (`python -S -E
program_group.py PGID MARKER`): the guard reads its stdin, a pipe only the host actor holds, and
ends the program once that reaches its end, that is once the host actor died (`ray.kill`, SIGKILL).
"""

from __future__ import annotations

import os
import signal
import sys
import time

#: How long the ending goes on looking for processes that a dying one has just started.
SETTLE_S = 2.0


def end(pgid: int, marker: bytes, within: float = SETTLE_S) -> None:
    """Kill the program's group, then every process that still carries the marker, until none is left."""
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


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:  # the group is already empty
        pass


if __name__ == "__main__":  # the guard
    sys.stdin.buffer.read()
    end(int(sys.argv[1]), os.fsencode(sys.argv[2]))
