"""Preemption notices: a host's node is about to go, and every host of the step hears it before the deadline.

Ray carries the notice: a node being drained (`DrainNode`, reason preemption, with a deadline)
is listed by the GCS with its deadline (`get_draining_nodes`). Autoscaler v2 drains a node that
its cloud is about to take; `ray drain-node` and `rayslice local preempt` do it by hand; and a
raylet whose `ray start` gets SIGTERM drains its own node first, with the deadline
`RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S` (30 s by default) ahead (Ray 2.60, `Node._drain_node_before_shutdown`),
so a VM shut down politely reads the same. Ray itself kills nothing at the deadline, and tells
no worker of a busy node: that is this module's job.

- `Watch` (the driver): polls the GCS for the reservation's nodes; the first draining one is
  the step's notice, published under the attempt's key in Ray's internal KV.
- `HostListener` (each host process): polls that key, then delivers the notice: a function step
  through `get_step_context()` (flag, deadline, callbacks), a command step as a signal to its
  program's process group and the `$RAYSLICE_NOTICE_FILE` it names.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable

from ray.experimental import internal_kv

from rayslice.core.context import PreemptionNotice

#: How often the driver asks the GCS for draining nodes, and hosts read the published notice.
POLL_S = 0.25
#: The KV namespace the notices live in (deleted when the attempt ends).
NAMESPACE = "rayslice-notices"
#: How long before the deadline the launcher stops a step that is still running: its capacity must be free
#: before the platform takes the node.
STOP_MARGIN_S = 3.0
#: The least time a step gets from hearing its notice to being stopped, whatever the deadline says.
MIN_GRACE_S = 5.0
#: After a noticed program's first process stopped, how long its other processes may still run to save.
LINGER_S = 60.0
#: A notice without a deadline (Ray's 0): how long the step may take to checkpoint and return.
DEFAULT_GRACE_S = 30.0
#: An offer to grow (an elastic step, more slices free) has no deadline: this far ahead, it never stops a step.
GROW_DEADLINE_S = 10 * 365 * 86400.0
#: A step with no resumption left (its preemption_retries used up) cannot gain from stopping early: its hosts
#: hear the notice only this long before the launcher's stop (at once when that is nearer), to write a last
#: checkpoint an Airflow retry resumes from. Until then it runs on, and may finish.
LAST_CALL_S = 30.0


def draining(node_ids: Iterable[str]) -> dict[str, float]:
    """Which of these Ray nodes are being drained, and their deadlines (epoch seconds; 0: none given)."""
    wanted = set(node_ids)
    found = ray_state().get_draining_nodes()
    return {node: deadline_ms / 1000 for node, deadline_ms in found.items() if node in wanted}


def ray_state():
    import ray._private.state

    return ray._private.state.state


class Watch:
    """The driver's watch over one attempt's nodes: the first drained node becomes the step's notice."""

    def __init__(self, key: str, node_ids: dict[str, str], poll: float = POLL_S,
                 requested: Callable[[], tuple | None] | None = None, resumable: bool = True) -> None:
        """`node_ids`: Ray node id -> the host it holds (its label), for the log line.

        `requested`: the admission queue's word that a higher-priority request suspends this step
        (why, grace seconds), or that an elastic step may grow (why, grace, True), or None: priority
        preemption takes the same path as a drained node; a later word replaces an offer to grow.
        `resumable`: whether a suspension could resume the step (a preemption retry left). If not,
        the hosts hear a notice only at its last call (`LAST_CALL_S` before the stop).
        """
        self.key = key
        self.resumable = resumable
        self._held = False  # a notice held back from the hosts until its last call (said once it comes)
        self._nodes = node_ids
        self._requested = requested
        self._poll = poll
        self.notice: PreemptionNotice | None = None
        self.noticed_at: float | None = None
        self._told = False
        self._tell_failed = False
        self._asked: tuple | None = None  # the queue's last word published
        self.offer: PreemptionNotice | None = None  # the last offer to grow told, kept when taken back
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rayslice-notice-watch", daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        if self.notice is not None:  # nothing was put otherwise: no GCS call for the many steps never noticed
            with contextlib.suppress(Exception):
                internal_kv._internal_kv_del(self.key, namespace=NAMESPACE)

    def _loop(self) -> None:
        """Until the attempt ends: a drained node, or the queue's word, becomes the notice; an earlier one replaces it.

        The watch keeps looking after the first notice: a priority notice (its grace) followed by a
        drain of one of the step's nodes with less time left must move the stop to that node's
        deadline, and name the node, so the retry avoids its slice. Telling the hosts is retried
        until the GCS takes it.
        """
        while not self._stop.is_set():
            try:
                found = draining(self._nodes) if self._nodes else {}
            except Exception:  # a busy GCS: the next poll asks again
                found = {}
            if found:
                node, deadline = min(found.items(), key=lambda item: item[1] or float("inf"))
                self.publish(PreemptionNotice(
                    deadline=deadline or time.time() + DEFAULT_GRACE_S,
                    reason=f"node {node[:12]} (host {self._nodes[node]}) is being drained for preemption",
                    node=node))
            elif (asked := self._requested() if self._requested is not None else None) and asked != self._asked:
                self._asked = asked
                why, grace = asked[:2]
                grow = len(asked) > 2 and bool(asked[2])
                self.publish(PreemptionNotice(deadline=time.time() + (GROW_DEADLINE_S if grow else grace),
                                              reason=why, grow=grow))
            elif not asked and self._asked is not None and self.notice is not None and self.notice.grow:
                self._withdraw_offer()
            if self.notice is not None and not self._told and not self.held_back():
                if self._held:
                    self._held = False
                    print(f"[rayslice] preemption notice: its last call ({self.notice.seconds_left:.0f} s to the "
                          "deadline): every host is told now", flush=True)
                self._tell_hosts()
            self._stop.wait(self._poll)

    def publish(self, notice: PreemptionNotice) -> None:
        """Make `notice` the step's, and tell every host.

        The first notice wins, unless a later one is a drained node of the step with an earlier
        deadline than the notice's (or the first named no node): then it replaces it.
        """
        current = self.notice
        if current is not None and notice.node and not current.node and notice.deadline >= current.deadline:
            # A drain after a priority notice, with a later deadline: the stop stays; the node is named, so
            # the retry avoids its slice.
            notice = PreemptionNotice(deadline=current.deadline, reason=f"{current.reason}; {notice.reason}",
                                      node=notice.node)
        elif current is not None and not ((notice.node or current.grow) and notice.deadline < current.deadline):
            return  # the first stands, unless this one is sooner and names a node or ends an offer to grow
        self.notice = notice
        if notice.grow:
            self.offer = notice
        if self.noticed_at is None or (current is not None and current.grow and not notice.grow):
            self.noticed_at = time.time()  # an offer to grow the step carried on past is no notice heard
        self._told = False
        if self.held_back():
            self._held = True
            print(f"[rayslice] preemption notice: {notice.reason}; deadline in {notice.seconds_left:.0f} s. The step "
                  "has no preemption retry left, so stopping early cannot help: it runs on, and its hosts are told "
                  f"{LAST_CALL_S:.0f} s before it is stopped (to checkpoint for an Airflow retry)", flush=True)
            return
        self._tell_hosts()
        if notice.grow:
            print(f"[rayslice] elastic: {notice.reason}; every host is told "
                  "(`get_step_context().preemption_notice.grow`): the step may checkpoint and raise StepSuspended "
                  "to resume on more slices, or carry on; nothing stops it", flush=True)
        elif current is None:
            print(f"[rayslice] preemption notice: {notice.reason}; deadline in {notice.seconds_left:.0f} s: every "
                  "host is told; the step may checkpoint and stop, or it is stopped before the deadline", flush=True)
        else:
            print(f"[rayslice] preemption notice replaced: {notice.reason}; deadline in {notice.seconds_left:.0f} s "
                  f"(was {current.reason})", flush=True)

    def _withdraw_offer(self) -> None:
        """The queue took its offer to grow back: the hosts see the notice key gone and drop the offer."""
        print("[rayslice] elastic: the offer to grow was taken back (those slices went to another step); "
              "the step carries on", flush=True)
        self.notice, self.noticed_at, self._asked = None, None, None
        with contextlib.suppress(Exception):
            internal_kv._internal_kv_del(self.key, namespace=NAMESPACE)

    def _tell_hosts(self) -> None:
        """Put the notice where the hosts read it; on a GCS error the watch's next poll tries again."""
        if self._stop.is_set():  # the attempt ended: nothing to tell, and no key to leave behind
            return
        try:
            internal_kv._internal_kv_put(self.key, self.notice.to_json(), namespace=NAMESPACE)
        except Exception as exc:
            if not self._tell_failed:
                print(f"[rayslice] could not tell the hosts of the preemption notice yet ({type(exc).__name__}: "
                      f"{exc}); trying again", flush=True)
            self._tell_failed = True
            return
        self._told = True

    def held_back(self) -> bool:
        """Whether the hosts are not told the notice yet: no resumption left, and its last call not yet come."""
        notice = self.notice
        if notice is None or notice.grow or self.resumable:
            return False
        stop = self.stop_at()
        return stop is not None and time.time() < stop - LAST_CALL_S

    def heard(self) -> PreemptionNotice | None:
        """What the hosts are told: the notice (or the last offer to grow, kept when taken back), unless held back.

        Only a told notice changes what the step's end means: a host's failure under a notice held
        back is its own. An offer to grow told before the notice came is still what the hosts heard:
        a step that stops for it stops to grow.
        """
        if self.held_back():
            return self.offer
        return self.notice or self.offer

    def hosts_stopping(self) -> bool:
        """Whether the step's hosts may be shutting down for a word of this watch (what the log drain explains).

        Only what the hosts were told counts: under a notice held back (no resumption left) a host's
        JAX termination is a real failure, and must reach the task log as one.
        """
        return self.heard() is not None

    def stop_at(self) -> float | None:
        """When the launcher stops the step (epoch seconds): a little before the deadline; None without a notice.

        At least `MIN_GRACE_S` after the notice was heard: a deadline already past on this
        machine's clock (a drainer's clock ahead of it, a notice heard late) still leaves the step
        a moment to checkpoint.
        """
        if self.notice is None:
            return None
        return max(self.notice.deadline - STOP_MARGIN_S, (self.noticed_at or time.time()) + MIN_GRACE_S)


class HostListener:
    """A host process's listener: reads the attempt's notice key, and calls `deliver(notice)` once."""

    def __init__(self, key: str, deliver: Callable[[PreemptionNotice], None], poll: float = POLL_S,
                 withdraw: Callable[[], None] | None = None) -> None:
        self._key = key
        self._deliver = deliver
        self._withdraw = withdraw
        self._poll = poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rayslice-notice-listener", daemon=True)

    def __enter__(self) -> HostListener:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def _loop(self) -> None:
        """Deliver the notice once it is there; after an offer to grow, keep reading: a real notice may replace
        it, or the queue take it back (the key deleted: `withdraw`)."""
        delivered: bytes | None = None
        while not self._stop.is_set():
            try:
                raw = internal_kv._internal_kv_get(self._key, namespace=NAMESPACE)
                read = True
            except Exception:
                raw, read = None, False
            if raw and raw != delivered:
                try:
                    notice = PreemptionNotice.from_json(raw)
                    self._deliver(notice)
                except Exception as exc:  # the notice must never fail the step itself
                    print(f"[rayslice] could not deliver the preemption notice: {type(exc).__name__}: {exc}",
                          flush=True)
                    return
                if not notice.grow:
                    return
                delivered = raw
            elif read and not raw and delivered is not None and self._withdraw is not None:
                self._withdraw()
                delivered = None
            self._stop.wait(self._poll)


class CommandNotice:
    """Delivers a notice to a command step's program: the notice file first, then the signal to its process group.

    A notice that comes after the program's first process ended is not delivered: the program
    never heard it (`heard_at` stays None), so its end is its own, not a stop for the notice.
    """

    def __init__(self, path: str, signal_name: str) -> None:
        self.path = path
        self._signal = None if signal_name == "none" else signal.Signals[signal_name]
        self._pid: int | None = None
        self._pending: PreemptionNotice | None = None
        self._ended = False
        self.heard_at: float | None = None  # when the notice reached the running program
        self.signalled_at: float | None = None  # when the notice's signal was sent to the running program
        self._lock = threading.Lock()

    def started(self, pid: int) -> None:
        """The program started (its own session: its pid is its process group); a notice already here goes now."""
        with self._lock:
            self._pid = pid
            pending = self._pending
        if pending is not None:
            self._signal_program()

    def deliver(self, notice: PreemptionNotice) -> None:
        with self._lock:
            if self._ended:
                return
            temp = f"{self.path}.tmp"
            with open(temp, "w") as f:
                f.write(notice.to_json())
            os.replace(temp, self.path)  # whole or absent: the program never reads half a notice
            self._pending, self.heard_at = notice, time.time()
            started = self._pid is not None
        if started:
            self._signal_program()
        print(f"[rayslice] preemption notice delivered to the program: {notice.reason}; "
              f"{notice.seconds_left:.0f} s to the deadline" + (f" ({self._signal.name} sent)" if self.signalled_at
                                                               else " (no signal sent: an offer to grow, notice_signal "
                                                               "none, or the program ended or ignores it)"),
              flush=True)

    def program_ended(self, code: int) -> float | None:
        """The program's first process ended with `code`: until when its other processes may still run.

        Only after a notice it heard, and only when it stopped for it (a signal or a non-zero status):
        a shell wrapper dies of the signal while the Python it started is still saving its checkpoint.
        That save gets until shortly before the deadline (at least `MIN_GRACE_S` after the notice came,
        at most `LINGER_S`). A program that finished (status 0) leaves nothing to wait for.
        """
        with self._lock:
            self._ended = True
            notice, heard = self._pending, self.heard_at
        if notice is None or heard is None or code == 0:
            return None
        now = time.time()
        return min(max(notice.deadline - STOP_MARGIN_S, heard + MIN_GRACE_S), now + LINGER_S)

    def _signal_program(self) -> None:
        """Send the notice's signal: from then on, a clean exit without a result reads as a stop for the notice."""
        if self._signal is None or self._pid is None or (self._pending is not None and self._pending.grow):
            return  # an offer to grow is only written to the notice file: no program is stopped for it
        with self._lock:
            if self._ended or not would_act_on(self._pid, self._signal):
                return  # a program that already ended, or that ignores the signal everywhere, was asked nothing
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._pid, self._signal)
                self.signalled_at = time.time()


def would_act_on(pgid: int, signum: int) -> bool:
    """Whether the program whose first process is `pgid` (its own process group) would act on `signum` now.

    A clean exit after the signal reads as a stop for the notice (docs/preemption.md), so the signal
    counts only where it can have stopped something: the first process still runs (`killpg` succeeds
    on a group whose leader exited 0 and is not reaped yet, or that holds only a helper it left), and
    some process of the group does not ignore it (a wrapper's `trap '' TERM` is inherited by the
    program it starts, which then runs to its end). Read from Linux's /proc; elsewhere, always True.
    """
    if not os.path.exists("/proc/self/stat"):
        return True  # no /proc (not Linux): sent, and read as heard
    try:
        if _proc_state(pgid)[0] in ("Z", "X"):
            return False
    except (OSError, ValueError, IndexError):
        return False  # its first process is gone
    bit = 1 << (signum - 1)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            state, group = _proc_state(int(entry))
            if group != pgid or state in ("Z", "X"):
                continue
            with open(f"/proc/{entry}/status") as f:
                ignored = next((int(line.split()[1], 16) for line in f if line.startswith("SigIgn:")), 0)
        except (OSError, ValueError, IndexError):
            continue  # it ended meanwhile
        if not ignored & bit:
            return True
    return False


def _proc_state(pid: int) -> tuple[str, int]:
    """A process's state letter and process group, from /proc/<pid>/stat (its name may hold spaces and ')')."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[2])
