"""The driver's last line comes after every host's: the hosts' output is seen arriving before it exits.

Kept apart from the gang's loop: it hooks Ray's log dispatcher in the driver, not the hosts, and
runs after the release (no chip waits on it).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rayslice.cluster import shutdown_noise
from rayslice.cluster.environments import HostPlan
from rayslice.core.exceptions import HostLostError, StepFailedError
from rayslice.core.step import HOST_DONE_MARKER


class LogDrain:
    """Sees the hosts' output arrive in this driver's log, so the driver's own last line comes after it.

    Ray forwards host output to the driver asynchronously (each node's log monitor tails the
    processes' files); a driver that printed its result and exited at once could lose a host's
    final lines, and after a failure those are the lines a user needs. Only where this driver
    prints host output.
    """

    #: The longest a drain waits, on success or failure. It runs after the release (no chip waits on it)
    #: and ends as soon as every host's last line is in; a loaded node's log monitor can lag for seconds.
    TIMEOUT_S = 15.0
    #: After a failure, how long host output must have been quiet: a killed host prints no last line. A node's
    #: log monitor reads a burst in batches, one pass over every open log file each, and a loaded node with
    #: hundreds of worker logs can take over a second a pass: a 1 s window lost a dead host's last lines once
    #: in a whole test run under load (not reproduced alone).
    QUIET_S = 3.0

    def __init__(self) -> None:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        self._dispatcher = dispatcher
        try:  # made once capacity is reserved: a Ray whose dispatcher differs must not cost the step
            self.active = any(pair[0] == "ray_print_logs" for pair in dispatcher.handlers
                              if isinstance(pair, tuple) and len(pair) == 2)
        except Exception:
            self.active = False
        self._done: set[str] = set()
        self._seen = threading.Condition()
        self._last_line = 0.0
        self._name = f"rayslice-drain-{id(self)}"
        self._explainers: list[shutdown_noise.Explainer] = []
        if self.active:
            dispatcher.add_handler(self._name, self._handle)

    def explain_shutdown(self, labels: set[str], noticed: Any) -> None:
        """Until `close`: these hosts' JAX termination after `noticed()` is explained, not shown as fatal."""
        if self.active:
            self._explainers.append(shutdown_noise.Explainer(self._dispatcher, labels, noticed))

    def _handle(self, data: dict) -> None:
        with self._seen:
            self._last_line = time.monotonic()
            for line in data.get("lines", ()):
                if line.startswith(HOST_DONE_MARKER):
                    self._done.add(line[len(HOST_DONE_MARKER):].strip())
            self._seen.notify_all()

    def wait(self, labels: list[str], *, quiet: float = 0.0) -> None:
        """Until every host in `labels` printed its last line and host output was quiet for `quiet` s; bounded.

        On success every host prints a last line. After a failure, the hosts that raised did
        (`HostProcess.run` prints it on the way out), and the ones that died or were killed
        did not: for those, `quiet` seconds without a line (counted from this call) stand for it.
        """
        if not self.active:
            return
        start = time.monotonic()
        deadline = start + self.TIMEOUT_S
        with self._seen:
            while True:
                now = time.monotonic()
                quiet_at = max(start, self._last_line) + quiet
                if now >= deadline or (self._done.issuperset(labels) and now >= quiet_at):
                    return
                self._seen.wait(min(deadline, quiet_at if self._done.issuperset(labels) else deadline) - now)

    def close(self) -> None:
        if self.active:
            self._dispatcher.remove_handler(self._name)
        for explainer in self._explainers:
            explainer.close()


def raised_on(exc: BaseException, plans: list[HostPlan]) -> list[str]:
    """The label of the host whose step raised `exc` (it printed its last line), if one did."""
    if not isinstance(exc, StepFailedError) or isinstance(exc, HostLostError):
        return []
    return [plan.label for plan in plans if (plan.slice_index, plan.worker_id) == (exc.slice_index, exc.worker_id)]
