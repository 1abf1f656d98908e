"""Command steps: the user's program (`command=[...]`) started on every host, as TPU users start it.

A host actor runs the argv in a child process from its working directory (the runtime env's
`working_dir`), with the environment the launcher planned (JAX's multi-controller variables, the
step context as `RAYSLICE_*`), relays each of its lines as it comes (Ray prefixes them with the
host), and returns the JSON the program left in `$RAYSLICE_RESULT_FILE`, or None. A non-zero exit
or a signal raises `CommandExitError` with the last lines and when the program ended; the gang
then fails at once, naming the host whose program ended first.

The program's exit ends its host's part of the step, whatever it leaves behind:
- It runs in its own session; once it ends, its process group is killed, and any process that left
  the group but carries this run's marker in its environment (`program_group.py`), so a background
  child (a log shipper, `tensorboard &`) neither holds the step nor outlives it.
- Its output is relayed until the pipes close, or once it ended, for what is already buffered
  and at most `DRAIN_S` more.
- Its exit status is known as soon as Python starts to exit (`jax_autodetect/rayslice_program.py`),
  before JAX's shutdown at exit, which blocks while the peers sit in a collective.
- A guard process (`program_group.py` as a script, reading a pipe only the host actor holds) does
  the same when the host actor dies, so cancelling the gang ends every process of the program.
"""

from __future__ import annotations

import collections
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

from rayslice.cluster import program_group
from rayslice.core.context import RESULT_FILE_ENV

#: How many of a failed command's last output lines its error carries.
TAIL_LINES = 20
#: Once the program ended: how long its relays may go on reading what its leftover processes write.
DRAIN_S = 2.0
#: A program that reported a failure as its threads are joined (not yet before JAX's shutdown): how long
#: its non-daemon threads and exit handlers may take before its host ends it.
EXIT_GRACE_S = 3.0
#: The folder on the program's PYTHONPATH: its sitecustomize reports to the host (and joins a simulated slice).
PROGRAM_HOOKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jax_autodetect")
REPORT_ENV = "RAYSLICE_PROGRAM_REPORT"  # rayslice_program.REPORT_ENV
HANG_INTERVAL_ENV = "RAYSLICE_HANG_INTERVAL"
EXIT_FILE = "exit.json"
#: How long the guard's first process may take to fork the guard away (a Python started with -S -E).
GUARD_START_S = 5.0
IDLE_FILE = "idle.json"  # where the program says since when it is idle in JAX (cluster/hang_watch.py reads it)


class CommandExitError(RuntimeError):
    """The command ended with a non-zero exit code (or a signal) on this host, at `ended_at` (epoch seconds)."""

    def __init__(self, message: str, exit_code: int = 1, ended_at: float | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.ended_at = ended_at

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.exit_code, self.ended_at)


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends SIGKILL when the host actor's process ends."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the group guard still ends it
        pass


def program_env(env: Mapping[str, str], report_dir: str, hang_interval: float = 0.0) -> dict[str, str]:
    """The program's variables: the host's Python first on PATH, the report hooks first on PYTHONPATH."""
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != PROGRAM_HOOKS]
    values = {**env, "PATH": os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
              "PYTHONPATH": os.pathsep.join([PROGRAM_HOOKS, *path]), REPORT_ENV: report_dir,
              RESULT_FILE_ENV: os.path.join(report_dir, "result.json")}
    if hang_interval > 0:
        values[HANG_INTERVAL_ENV] = str(hang_interval)
    return values


def run(argv: list[str], env: Mapping[str, str], report_dir: str, hang_interval: float = 0.0,
        on_start: Callable[[int], None] | None = None,
        on_end: Callable[[int], float | None] | None = None) -> Any:
    """Run `argv` to its end, relaying its output; its result file's JSON, None, or CommandExitError.

    `report_dir` is an empty folder of this host's: the program's result file and its reports go there.
    `python` means the host's own Python (the runtime env's, with its packages): its folder goes first on PATH.
    `on_start(pid)` is called once the program runs (its pid is its process group: a preemption notice signals it).
    `on_end(status)` is called once the program's first process ended (or reported its status); it says
    until when (epoch seconds) the program's other processes may still run, to finish a checkpoint
    after a preemption notice, or None: they are ended at once, as always.
    """
    env = program_env(env, report_dir, hang_interval)
    if argv[0] in ("python", "python3"):
        argv = [sys.executable, *argv[1:]]
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    marker = f"{REPORT_ENV}={report_dir}"
    guard = _guard(marker)  # before the program: a host killed as the program starts still has it ended
    try:
        child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL, start_new_session=True,
                                 preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    except OSError as exc:
        _tell(guard, program_group.DONE)
        raise CommandExitError(f"command {argv[0]!r} could not start in {os.getcwd()}: {exc.strerror or exc}",
                               127, time.time()) from None
    started = program_group.start_time(child.pid)  # not reaped yet: the number is still the program's
    _tell(guard, program_group.group_word(child.pid, started), close=False)
    if on_start is not None:
        on_start(child.pid)
    relays = [_Relay(stream, out, tail) for stream, out in ((child.stdout, sys.stdout), (child.stderr, sys.stderr))]
    code: int | None = None
    try:
        code, ended_at = _wait(child, os.path.join(report_dir, EXIT_FILE))
    finally:  # also when this actor is interrupted: nothing of the program outlives its end
        until = on_end(code) if on_end is not None and code is not None else None
        if until is not None:
            _linger(os.fsencode(marker), until, child.pid)
        program_group.end(child.pid, os.fsencode(marker), started=started)  # reaped already: its number may be reused
        child.wait()
        _tell(guard, program_group.DONE)  # the program is ended: the guard stands down
        for relay in relays:
            relay.finish(DRAIN_S)
    if code != 0:
        how = f"exit code {code}" if code > 0 else f"signal {_signal_name(-code)}"
        last = "\n".join(f"  | {line}" for line in tail) or "  (no output)"
        raise CommandExitError(f"command {' '.join(argv)!r} ended with {how}; its last output lines:\n{last}",
                               code, ended_at)
    result_file = env[RESULT_FILE_ENV]
    if not os.path.exists(result_file):
        return None
    with open(result_file) as f:
        text = f.read()
    try:
        return json.loads(text) if text.strip() else None
    except ValueError as exc:
        raise CommandExitError(f"the command's ${RESULT_FILE_ENV} holds no JSON ({exc}): {text[:200]!r}", 0,
                               ended_at) from None


def _linger(marker: bytes, until: float, first: int) -> None:
    """Wait (until `until`) while the program's other processes still run: after a notice they may be saving.

    `first`, the process whose end (or reported status) decided, is not waited for: one that reported
    its status early may sit in JAX's shutdown barrier, waiting for peers that left.
    """
    while time.time() < until and [pid for pid in program_group.marked(marker) if pid != first]:
        time.sleep(0.1)


def _wait(child: subprocess.Popen, exit_file: str) -> tuple[int, float]:
    """The program's exit status and when it ended: its process's end, or the failure it reported first.

    A program process that joined a JAX group writes a non-zero status as Python starts to exit,
    before JAX's shutdown (which blocks while its peers sit in a collective): that status decides.
    The process's own end is waited for in a thread, so a signal's time is exact too.
    """
    ended: list[float] = []
    done = threading.Event()

    def wait() -> None:
        child.wait()
        ended.append(time.time())
        done.set()

    threading.Thread(target=wait, name="rayslice-program-wait", daemon=True).start()
    while not done.wait(0.05):
        reported = _read_json(exit_file)
        if reported and reported.get("exit_code"):
            at = float(reported.get("time") or time.time())
            if reported.get("final", True) or time.time() - at >= EXIT_GRACE_S:
                return int(reported["exit_code"]), at
    assert child.returncode is not None
    reported = _read_json(exit_file)  # killed by the host's own end: its reported status is the truer one
    if child.returncode != 0 and reported and reported.get("exit_code"):
        return int(reported["exit_code"]), float(reported.get("time") or ended[0])
    return child.returncode, ended[0]


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _guard(marker: str) -> subprocess.Popen | None:
    """A small process that ends the program once the host actor is gone (its stdin pipe reads EOF).

    Only this actor holds the pipe's write end, so any death of the actor (`ray.kill`, SIGKILL)
    closes it. Started before the program (which does not inherit that end: close_fds). It forks
    away at once (`program_group.guard`) and its first process is reaped here, so a dying Ray worker,
    which kills its own children first, cannot kill it. No site, no environment: it starts in
    milliseconds and imports nothing of the program's.
    """
    try:
        guard = subprocess.Popen([sys.executable, "-S", "-E", program_group.__file__, marker],
                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)
    except OSError:  # the parent-death signal still ends the program itself
        return None
    try:
        guard.wait(GUARD_START_S)  # its first process exits once the guard has forked away
    except subprocess.TimeoutExpired:
        pass  # a loaded host: it still guards, as the host's child until it forks
    return guard


def _tell(guard: subprocess.Popen | None, word: bytes, *, close: bool = True) -> None:
    """One line to the guard (`program_group.GROUP`, `DONE`); closing the pipe after `DONE` lets it exit."""
    if guard is None or guard.stdin is None:
        return
    try:
        guard.stdin.write(word + b"\n")
        guard.stdin.flush()
        if close:
            guard.stdin.close()
    except (OSError, ValueError):  # it died: nothing to tell
        pass
    if close:
        try:
            guard.wait(GUARD_START_S)
        except subprocess.TimeoutExpired:
            pass


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


class _Relay(threading.Thread):
    """Copies one of the program's pipes to this actor's stream line by line, keeping the last lines.

    Reads until the pipe closes; once `finish` is called (the program ended), only until nothing
    more is buffered, and for `within` seconds at most.
    """

    def __init__(self, stream: IO[bytes] | None, out: IO[str], tail: collections.deque[str]) -> None:
        super().__init__(name="rayslice-relay", daemon=True)
        assert stream is not None
        self._stream, self._out, self._tail = stream, out, tail
        self._until: float | None = None
        self.start()

    def finish(self, within: float) -> None:
        self._until = time.monotonic() + within
        self.join(within + 1.0)

    def run(self) -> None:
        # poll, not select: select refuses a descriptor past 1023, and a host process may hold that many.
        fd, pending, poller = self._stream.fileno(), bytearray(), select.poll()
        poller.register(fd, select.POLLIN | select.POLLPRI)
        try:
            while True:
                if not poller.poll(100):
                    if self._until is not None:
                        break
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                start = 0  # only the new bytes are searched and copied: a line with no end (a progress bar's
                while (end := chunk.find(b"\n", start)) >= 0:  # `\r`s) costs linear time, not quadratic
                    pending += chunk[start:end]
                    self._emit(bytes(pending))
                    pending.clear()
                    start = end + 1
                pending += chunk[start:]
                if self._until is not None and time.monotonic() > self._until:
                    break
            if pending:
                self._emit(bytes(pending))
        finally:
            self._stream.close()

    def _emit(self, raw: bytes) -> None:
        line = raw.decode(errors="replace")
        self._tail.append(line)
        print(line, file=self._out, flush=True)


def written_result(report_dir: str) -> tuple[Any] | None:
    """The JSON the program left in its result file, as a 1-tuple (it may be null), or None if it wrote none.

    After a preemption notice's signal ended a program, a result already written means it had finished.
    """
    text = None
    try:
        with open(os.path.join(report_dir, "result.json")) as f:
            text = f.read()
        return (json.loads(text) if text.strip() else None,)
    except (OSError, ValueError):
        return None
