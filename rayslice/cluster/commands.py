"""Command steps: the user's program (`command=[...]`) started on every host, as TPU users start it.

A host actor runs the argv in a child process from its working directory (the runtime env's
`working_dir`), with the environment the launcher planned (JAX's multi-controller variables, the
step context as `RAYSLICE_*`), relays each of its lines as it comes (Ray prefixes them with the
host), and returns the JSON the program left in `$RAYSLICE_RESULT_FILE`, or None. A non-zero exit
raises `CommandExitError` with the last lines; the gang then fails at once, as for a function.
The child is killed with its host actor (Linux parent-death signal), so cancelling the gang ends it.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from typing import IO, Any

from rayslice.core.context import RESULT_FILE_ENV

#: How many of a failed command's last output lines its error carries.
TAIL_LINES = 20


class CommandExitError(RuntimeError):
    """The command ended with a non-zero exit code (or a signal) on this host."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.exit_code)


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends SIGKILL when the host actor's process ends."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: killing the gang leaves the child to its own end
        pass


def run(argv: list[str], env: Mapping[str, str]) -> Any:
    """Run `argv` to its end, relaying its output; its result file's JSON, None, or CommandExitError.

    `python` means the host's own Python (the runtime env's, with its packages): its folder goes first on PATH.
    """
    bin_dir = os.path.dirname(sys.executable)
    env = {**env, "PATH": bin_dir + os.pathsep + env.get("PATH", "")}
    if argv[0] in ("python", "python3"):
        argv = [sys.executable, *argv[1:]]
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    with tempfile.TemporaryDirectory(prefix="rayslice-result-") as folder:
        result_file = os.path.join(folder, "result.json")
        try:
            child = subprocess.Popen(argv, env={**env, RESULT_FILE_ENV: result_file}, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        except OSError as exc:
            raise CommandExitError(f"command {argv[0]!r} could not start in {os.getcwd()}: {exc.strerror or exc}",
                                   127) from None
        relays = [threading.Thread(target=_relay, args=(stream, out, tail), daemon=True)
                  for stream, out in ((child.stdout, sys.stdout), (child.stderr, sys.stderr))]
        for relay in relays:
            relay.start()
        code = child.wait()
        for relay in relays:
            relay.join()
        if code != 0:
            how = f"exit code {code}" if code > 0 else f"signal {_signal_name(-code)}"
            last = "\n".join(f"  | {line}" for line in tail) or "  (no output)"
            raise CommandExitError(f"command {' '.join(argv)!r} ended with {how}; its last output lines:\n{last}",
                                   code)
        if not os.path.exists(result_file):
            return None
        with open(result_file) as f:
            text = f.read()
    try:
        return json.loads(text) if text.strip() else None
    except ValueError as exc:
        raise CommandExitError(f"the command's ${RESULT_FILE_ENV} holds no JSON ({exc}): {text[:200]!r}", 0) from None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _relay(stream: IO[bytes] | None, out: IO[str], tail: collections.deque[str]) -> None:
    assert stream is not None
    for raw in stream:
        line = raw.decode(errors="replace").rstrip("\n")
        tail.append(line)
        print(line, file=out, flush=True)
    stream.close()
