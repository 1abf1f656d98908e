"""The simulation's hang detector: a step whose hosts all sit idle inside JAX fails instead of holding its slice.

On the simulated cluster (JAX on CPU, gloo collectives across processes) a program whose processes
disagree on their collectives (one skips or reorders one) blocks every host process forever, and no
error ever comes. Each host process of a simulated slice runs a `HostWatch` thread: the host is idle
when its process's CPU time did not advance over a sampling interval *and* the step's thread is
blocked inside JAX (a jax/jaxlib frame on its Python stack). A step that sleeps or waits in plain
Python is never idle in this sense, nor is a host that computes while its peers wait for it.

Each host publishes since when it has been idle in Ray's GCS key-value store (no extra actor, no
second thread in the host actor's Ray task loop); the driver reads them between its `ray.wait`
rounds and fails the step with `CollectiveHangError` once every still-running host has been idle
for the step's `hang_timeout`. On real TPUs nothing is published and `step_timeout` covers hangs.

A command step's JAX runs in its program, a child of the host process: the program samples itself the
same way (`jax_autodetect/rayslice_program.py`, once it joined its JAX group) and writes its state to a
file, which the host's watch publishes instead of its own.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

from ray.experimental import internal_kv

# One reading of "idle inside JAX" for both kinds of step: a command step's program samples itself with
# the same stdlib-only code (it cannot import rayslice or Ray).
from rayslice.cluster.jax_autodetect.rayslice_program import IDLE_CPU_SHARE, jax_frame

NAMESPACE = "rayslice-hang-watch"


def poll_interval(hang_timeout: float) -> float:
    """How often hosts sample and the driver reads: often enough to fire within ~10% of the bound."""
    return max(0.2, min(5.0, hang_timeout / 10))


class HostWatch:
    """Samples this process (CPU time, the step thread's stack) and publishes since when it is idle in JAX."""

    def __init__(self, key: str, step_thread: int, interval: float, program_state: str | None = None) -> None:
        """`program_state`: a command step's, whose JAX runs in its program: the file where that samples itself."""
        self._key = key.encode()
        self._program_state = program_state
        self._step_thread = step_thread
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rayslice-hang-watch", daemon=True)

    def __enter__(self) -> HostWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        internal_kv._internal_kv_del(self._key, namespace=NAMESPACE)

    def _loop(self) -> None:
        cpu, idle_since, published = time.process_time(), None, None
        while not self._stop.wait(self._interval):
            if self._program_state is not None:
                state = _program_state(self._program_state)
                if state != published:
                    internal_kv._internal_kv_put(self._key, json.dumps(state), namespace=NAMESPACE)
                    published = state
                continue
            now_cpu = time.process_time()
            busy = now_cpu - cpu > IDLE_CPU_SHARE * self._interval
            cpu = now_cpu
            where = jax_frame(self._step_thread)
            if busy or where is None:
                idle_since = None
            elif idle_since is None:
                idle_since = time.time() - self._interval
            state = {"idle_since": idle_since, "where": where if idle_since is not None else None}
            if state != published:
                internal_kv._internal_kv_put(self._key, json.dumps(state), namespace=NAMESPACE)
                published = state


def _program_state(path: str) -> dict:
    """What a command step's program last wrote (`jax_autodetect/rayslice_program.py`); not idle before it did."""
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return {"idle_since": None, "where": None}
    return {"idle_since": state.get("idle_since"), "where": state.get("where")}


@dataclass(frozen=True)
class HostState:
    label: str
    idle_since: float | None
    where: str | None


def read(keys: dict[str, str]) -> list[HostState]:
    """The published state of each host (label -> key); a host that published nothing is not idle."""
    states = []
    for label, key in keys.items():
        raw = internal_kv._internal_kv_get(key.encode(), namespace=NAMESPACE)
        state = json.loads(raw) if raw else {}
        states.append(HostState(label, state.get("idle_since"), state.get("where")))
    return states


def all_idle_for(states: list[HostState], now: float | None = None) -> float:
    """For how long every host has been idle at once (0 when one is not)."""
    if not states or any(s.idle_since is None for s in states):
        return 0.0
    return max(0.0, (now or time.time()) - max(s.idle_since for s in states))


def forget(keys: dict[str, str]) -> None:
    for key in keys.values():
        internal_kv._internal_kv_del(key.encode(), namespace=NAMESPACE)
