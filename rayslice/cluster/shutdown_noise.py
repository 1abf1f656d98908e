"""A suspension's expected shutdown noise, explained in the task log instead of shown as a fatal error.

When a gang is suspended (a preemption notice, a priority suspension, a stop to grow), the hosts that
stop first leave JAX's coordination service, and their peers' JAX then ends its own process with a
fatal log line: "Terminating process because the JAX distributed service detected fatal errors". That
is the suspension working, not a failure; shown as it comes, it reads like one, on every suspension.

The driver prints its hosts' output through Ray's log dispatcher. While an attempt runs and its last
lines drain, a filter placed before Ray's printer rewrites that one line, from this attempt's hosts
and only once the attempt heard its notice, into `EXPLAINED`. Every other line passes as it came: a
real error after the notice, any line before it, and other attempts' hosts.
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
_names = itertools.count()


class Explainer:
    """Rewrites `FATAL_SIGN` lines of `labels`' hosts once `noticed()`, before Ray's printer sees them."""

    def __init__(self, dispatcher: Any, labels: set[str], noticed: Callable[[], bool]) -> None:
        self._dispatcher, self._labels, self._noticed = dispatcher, set(labels), noticed
        self._name = f"rayslice-shutdown-noise-{next(_names)}"
        with dispatcher._lock:  # first: every handler after it (Ray's printer) gets the rewritten lines
            dispatcher.handlers = [(self._name, self._handle), *dispatcher.handlers]

    def _handle(self, data: dict) -> None:
        lines = data.get("lines")
        if not lines or data.get("actor_name") not in self._labels:
            return
        if any(FATAL_SIGN in line for line in lines) and self._noticed():
            data["lines"] = [EXPLAINED if FATAL_SIGN in line else line for line in lines]

    def close(self) -> None:
        self._dispatcher.remove_handler(self._name)
