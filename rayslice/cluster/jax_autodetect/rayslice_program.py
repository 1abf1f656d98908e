"""What a command step's program process tells its host actor: how it ends, and whether it sits idle in JAX.

Imported by this folder's `sitecustomize` when the host set `RAYSLICE_PROGRAM_REPORT` (a folder the host
reads). Only the process that joins the step's JAX group reports, from the moment
`jax.distributed.initialize()` returns; stdlib only, nothing from rayslice or Ray.

- **Its exit status, before JAX's shutdown.** JAX leaves its group in an `atexit` handler, a barrier with
  its peers; a process that exits while its peers sit in a collective blocks there for minutes, so its
  host would not see it end. A handler registered after JAX's runs before it and writes the status
  (`exit.json`) at once; the host then ends the program and fails the step with that status. The status
  is the uncaught `SystemExit`'s code (`sys.monitoring` sees it raised and, if caught, handled), or 1 after
  an uncaught exception (`sys.last_exc`; SIGINT after a `KeyboardInterrupt`), as the process will exit with
  it (`sys.exit(-1)` is 255). Only a non-zero status is written: a clean exit waits at the barrier as JAX
  means it to. Python joins the program's non-daemon threads before `atexit` (a loader thread blocked
  on its dead consumer never ends), so the status is written first as the threads are joined
  (`"final": false`: the host gives the program `commands.EXIT_GRACE_S` to end by itself), then again
  right before JAX's shutdown (`"final": true`: the host ends the program at once).
- **Whether it is idle inside JAX** (simulated slices, `RAYSLICE_HANG_INTERVAL` set): a thread samples the
  process's CPU time and its main thread's stack, as `cluster/hang_watch.py` does for function steps, and
  writes since when it has been idle (`idle.json`); the host publishes that for the driver's hang check.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time

REPORT_ENV = "RAYSLICE_PROGRAM_REPORT"
HANG_INTERVAL_ENV = "RAYSLICE_HANG_INTERVAL"
EXIT_FILE = "exit.json"
IDLE_FILE = "idle.json"
#: CPU-seconds per wall-second below which a process counts as idle (Ray's own threads use a little);
#: cluster/hang_watch.py uses this and `jax_frame` for function steps too.
IDLE_CPU_SHARE = 0.05

_pending_exit: list[object] = []  # the code of a SystemExit on its way out of the main thread
_reported_at: list[float] = []  # when the status was first written
_joined_pid: list[int] = []  # the process that joined: a child forked later inherits the handlers, not the voice


def joined_group() -> None:
    """Called once `jax.distributed` initialized in this process: start reporting."""
    folder = os.environ.get(REPORT_ENV)
    if not folder:
        return
    _joined_pid[:] = [os.getpid()]
    _watch_system_exit()
    try:  # runs before Python joins the non-daemon threads, which may never end
        threading._register_atexit(_report_exit, folder, False)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        pass
    atexit.register(_report_exit, folder, True)  # after JAX's own handler, so it runs before it
    interval = float(os.environ.get(HANG_INTERVAL_ENV) or 0)
    if interval > 0:
        threading.Thread(target=_sample_idle, args=(folder, interval, threading.main_thread().ident),
                         name="rayslice-idle", daemon=True).start()


def _write(folder: str, name: str, value: dict) -> None:
    """Atomically, so the host never reads half a file."""
    path = os.path.join(folder, name)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def _exit_code(code: object) -> int:
    """The status the process exits with for `SystemExit(code)`: the shell sees `sys.exit(-1)` as 255."""
    if code is None:
        return 0
    return code & 0xFF if isinstance(code, int) else 1  # a message: Python prints it and exits 1


def _report_exit(folder: str, final: bool) -> None:
    if _joined_pid != [os.getpid()]:
        return
    if _pending_exit:
        status = _exit_code(_pending_exit[-1])
    else:
        last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # Python < 3.12: last_value
        # An uncaught KeyboardInterrupt: Python ends itself with SIGINT (a negative status is a signal).
        status = 0 if last is None else -signal.SIGINT if isinstance(last, KeyboardInterrupt) else 1
    if status != 0:
        if not _reported_at:
            _reported_at.append(time.time())
        try:
            _write(folder, EXIT_FILE, {"exit_code": status, "time": _reported_at[0], "final": final})
        except OSError:  # the host is gone: nothing to tell
            pass


def _watch_system_exit() -> None:
    """Note a SystemExit raised in the main thread, and forget it once a handler catches it."""
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:  # Python < 3.12: sys.exit() alone is seen
        exit_ = sys.exit

        def patched(code: object = None) -> None:
            _pending_exit.append(code)
            exit_(code)

        sys.exit = patched
        return
    tool = next((i for i in (4, 3, 2, 1, 0) if monitoring.get_tool(i) is None), None)
    if tool is None:
        return
    monitoring.use_tool_id(tool, "rayslice exit status")
    main = threading.main_thread()

    def raised(code: object, offset: int, exc: BaseException) -> None:
        if isinstance(exc, SystemExit) and threading.current_thread() is main:
            _pending_exit[:] = [exc.code]

    def handled(code: object, offset: int, exc: BaseException) -> None:
        if isinstance(exc, SystemExit) and threading.current_thread() is main:
            _pending_exit.clear()

    monitoring.register_callback(tool, monitoring.events.RAISE, raised)
    monitoring.register_callback(tool, monitoring.events.EXCEPTION_HANDLED, handled)
    monitoring.set_events(tool, monitoring.events.RAISE | monitoring.events.EXCEPTION_HANDLED)


def jax_frame(thread_id: int | None) -> str | None:
    """Where the thread is blocked inside JAX ("jax function, called from file:line"), or None if not in JAX."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    innermost_jax = None
    while frame is not None:
        in_jax = any(part in frame.f_code.co_filename for part in ("/jax/", "/jaxlib/"))
        if in_jax and innermost_jax is None:
            innermost_jax = frame.f_code.co_name
        elif not in_jax and innermost_jax is not None:
            return f"{innermost_jax}, called from {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return innermost_jax


def _sample_idle(folder: str, interval: float, main_thread: int | None) -> None:
    cpu, idle_since, written = time.process_time(), None, None
    while True:
        time.sleep(interval)
        now_cpu = time.process_time()
        busy = now_cpu - cpu > IDLE_CPU_SHARE * interval
        cpu = now_cpu
        where = jax_frame(main_thread)
        if busy or where is None:
            idle_since = None
        elif idle_since is None:
            idle_since = time.time() - interval
        state = {"idle_since": idle_since, "where": where if idle_since is not None else None}
        if state != written:
            try:
                _write(folder, IDLE_FILE, state)
            except OSError:
                return
            written = state
