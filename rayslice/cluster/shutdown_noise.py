"""A suspension's expected shutdown noise, explained in the task log instead of shown as a fatal error.

When a gang is suspended (a preemption notice, a priority suspension, a stop to grow), the hosts that
stop first leave JAX's coordination service, and their peers' JAX then ends its own process with a
fatal log line: "Terminating process because the JAX distributed service detected fatal errors". That
is the suspension working, not a failure; shown as it comes, it reads like one, on every suspension.

The driver prints its hosts' output through Ray's log dispatcher. While an attempt runs and its last
lines drain, a filter placed before Ray's printer rewrites that one line, from this attempt's hosts
and only once the attempt heard its notice, into `EXPLAINED` and the status JAX gave: a line is judged
as it reaches the driver, so a real failure's line may arrive after the notice, and its cause stays.
Every other line passes as it came: a real error after the notice, any line before it, and other
attempts' hosts.

The filter reaches into Ray's dispatcher (its lock and handler list) and runs on Ray's one log thread,
inside `emit`: it must never cost the step or the log. On a Ray whose dispatcher differs it stands aside
(the lines show as they come, and the driver says so once); a failure of its own passes the line as it came
(an exception out of `emit` would end Ray's print thread: every later line of the driver lost).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

#: What JAX's coordination client logs (a glog fatal line) as it ends a process whose peers went away.
FATAL_SIGN = "Terminating process because the JAX distributed service detected fatal errors"
#: What the task log gets instead, after the host's prefix.
EXPLAINED = ("[rayslice] JAX ended this host's process because its peers had already stopped for the preemption "
             "notice: the suspension's expected shutdown, not an error")
#: Where JAX's line says what went wrong (kept: a real failure's line may reach the driver after the notice).
STATUS_SIGN = "absl::Status:"
_names = itertools.count()


def explained(line: str) -> str:
    """`EXPLAINED`, and the status JAX gave, if any: the fatal wording goes, the cause stays."""
    status = line.partition(STATUS_SIGN)[2].strip()
    return EXPLAINED + (f" (JAX's status: {status})" if status else "")


class Explainer:
    """Rewrites `FATAL_SIGN` lines of `labels`' hosts once `noticed()`, before Ray's printer sees them."""

    def __init__(self, dispatcher: Any, labels: set[str], noticed: Callable[[], bool]) -> None:
        self._dispatcher, self._labels, self._noticed = dispatcher, set(labels), noticed
        self._name = f"rayslice-shutdown-noise-{next(_names)}"
        self.active = False
        try:
            with dispatcher._lock:  # first: every handler after it (Ray's printer) gets the rewritten lines
                handlers = list(dispatcher.handlers)
                if not all(isinstance(pair, tuple) and len(pair) == 2 for pair in handlers):
                    raise TypeError(f"handlers are {type(handlers[0]).__name__}, not (name, handler)")
                dispatcher.handlers = [(self._name, self._handle), *handlers]
                self.active = True
        except Exception as exc:  # a Ray whose dispatcher differs: the lines show as they come
            print(f"[rayslice] a suspension's JAX shutdown lines are shown as they come (this Ray's log dispatcher "
                  f"differs: {type(exc).__name__}: {exc})", flush=True)

    def _handle(self, data: dict) -> None:
        try:
            lines = data.get("lines")
            if not lines or data.get("actor_name") not in self._labels:
                return
            if any(FATAL_SIGN in line for line in lines) and self._noticed():
                data["lines"] = [explained(line) if FATAL_SIGN in line else line for line in lines]
        except Exception:  # never out of Ray's emit: the line passes as it came
            return

    def close(self) -> None:
        if self.active:
            self._dispatcher.remove_handler(self._name)
