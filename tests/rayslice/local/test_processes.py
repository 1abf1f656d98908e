"""rayslice.local.processes on real processes: a session's whole tree is found and ended, nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

from rayslice.local import processes
from tests.conftest import end_sessions, wait_until


def test_a_sessions_tree_is_found_by_session_and_by_name_and_ended():
    marker = f"rs-proc-{uuid.uuid4().hex[:8]}"
    # A session leader with a child of its own, as `ray start --block` has; the marker names both.
    code = ("import subprocess, sys, time; "
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{marker}']); time.sleep(60)")
    code += f"  # {marker}"
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)  # someone else's process
    try:
        members = wait_until(lambda: (m := processes.session_members({leader.pid})) and len(m) == 2 and m, timeout=20)
        assert members and leader.pid in members and os.getpid() not in members
        assert processes.session_members(set(), naming=marker) == members
        assert other.pid not in members and processes.alive(other.pid)
        for pid in members:
            processes.send_signal(pid, signal.SIGKILL)
        leader.wait(timeout=10)
        assert wait_until(lambda: not processes.session_members({leader.pid}), timeout=10)
        assert not processes.alive(leader.pid)  # reaped
        processes.send_signal(leader.pid, signal.SIGKILL)  # already gone: no error
    finally:
        end_sessions(leader, other)


def test_a_zombie_is_not_alive():
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while processes.alive(child.pid) and time.monotonic() < deadline:  # exited, not yet reaped: a zombie
        time.sleep(0.05)
    assert not processes.alive(child.pid) and child.poll() == 0


def test_sessions_running_a_named_process_are_found_and_only_while_it_lives(tmp_path):
    # A node's `ray start` session with its raylet as a child: the raylet is found by its process name.
    raylet = tmp_path / "raylet"
    raylet.symlink_to("/bin/sleep")
    leader = subprocess.Popen(["sh", "-c", f"{raylet} 60 & exec sleep 60"], start_new_session=True)
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert wait_until(lambda: leader.pid in processes.sessions_running("raylet"), timeout=10)
        assert other.pid not in processes.sessions_running("raylet")
        child = next(pid for pid in processes.session_members({leader.pid}) if pid != leader.pid)
        processes.send_signal(child, signal.SIGKILL)  # the raylet dies; its session leader lives on
        assert wait_until(lambda: leader.pid not in processes.sessions_running("raylet"), timeout=10)
        assert processes.alive(leader.pid)
    finally:
        end_sessions(leader, other)
