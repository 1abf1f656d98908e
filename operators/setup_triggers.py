"""Triggers that wait in the triggerer for what a setup operator asked for: a RayCluster's head, or slices ACTIVE.

Why: a RayCluster takes minutes to be ready and a queued resource can wait an hour for
capacity; waited for on a worker, that is a worker slot doing nothing. A deferrable create
operator makes the resource on a worker (a few short calls), defers to one of these, and resumes
only to return the result or, when the wait failed, to delete what it made (a failed setup skips
its teardown, so nothing else would).

A passing API failure (5xx, 429, a reset connection) is looked at again until the deadline, never
a reason to delete. The Kubernetes and Cloud TPU clients block, so each look runs in a thread (`asyncio.to_thread`),
one at a time and bounded by the client's own timeout; between looks the trigger sleeps on the
event loop. It keeps the operator's deadline (`ready_timeout`, `active_timeout`) itself and
reports it as an event, so the operator's cleanup runs; Airflow's deferral timeout, set a little
later, is only a safety net.

`on_kill()`: when the user marks the deferred setup failed or success, or clears it, the trigger
deletes what this run made, as the worker path's `on_kill` does; when it only moved to another
triggerer (the task is still ``deferred``), it touches nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent
from rayslice.operators.triggers import UNKNOWN_STATE, shielded, task_state

__all__ = ["QueuedSliceActiveTrigger", "RayClusterReadyTrigger", "retry_passing"]

#: Tries of a cleanup call (deleting what a failed setup made) through passing API failures.
CLEANUP_TRIES = 4


def retry_passing(call: Any, *, tries: int = CLEANUP_TRIES, pause: float = 2.0) -> Any:
    """`call()`, again after a passing API failure (the error's `transient`), `tries` times in all.

    A failed setup's delete that meets a 5xx would otherwise leave the resource behind for good.
    """
    for attempt in range(1, tries + 1):
        try:
            return call()
        except Exception as exc:
            if attempt == tries or not getattr(exc, "transient", False):
                raise
            time.sleep(pause * attempt)

#: How much later than its own deadline Airflow's deferral timeout fires (the trigger reports first).
DEFERRAL_GRACE_S = 120.0


class _SetupTrigger(BaseTrigger):
    """Look every `poll_interval` s until the resource is ``ready``, failed (``error``) or late (``timeout``)."""

    def __init__(self, *, owner: str, deadline: float, timeout: float, poll_interval: float,
                 call_timeout: float = 60.0) -> None:
        super().__init__()
        self.owner = owner
        self.deadline = deadline
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.call_timeout = call_timeout
        self._client: Any = None

    def _kwargs(self) -> dict[str, Any]:
        return {"owner": self.owner, "deadline": self.deadline, "timeout": self.timeout,
                "poll_interval": self.poll_interval, "call_timeout": self.call_timeout}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            while True:
                try:
                    ready, why = await asyncio.to_thread(self._look)
                except Exception as exc:
                    if not getattr(exc, "transient", False):
                        raise
                    # A 5xx during a control-plane upgrade, a reset connection: not a reason to delete what
                    # was made (a queued resource would lose its place in the queue). Look again until the deadline.
                    self.log.warning("[rayslice] %s: %s; looking again", self._what(), exc)
                    ready, why = None, str(exc)
                if ready is not None:
                    yield TriggerEvent({"status": "ready", **ready})
                    return
                if time.time() >= self.deadline:
                    yield TriggerEvent({"status": "timeout", "message": self._late(why)})
                    return
                await asyncio.sleep(max(0.0, min(self.poll_interval, self.deadline - time.time())))
        except Exception as exc:  # the operator deletes what it made, then raises this
            yield TriggerEvent({"status": "error", "message": str(exc) or type(exc).__name__})

    async def cleanup(self) -> None:
        """Close the client; never touch the resource (a triggerer restart must not delete it)."""
        client, self._client = self._client, None
        if client is not None:
            await asyncio.to_thread(self._close, client)

    async def on_kill(self) -> None:
        await shielded(self._kill())

    async def _kill(self) -> None:
        state = await task_state(self, self.call_timeout, about=self._what())
        if state == "deferred":
            self.log.info("[rayslice] the trigger waiting for %s moved to another triggerer: leaving it", self._what())
            return
        if state == UNKNOWN_STATE:
            self.log.warning("[rayslice] Airflow did not say whether the setup was stopped or its trigger moved: "
                             "leaving %s (delete it yourself if the task was stopped)", self._what())
            return
        outcome = await asyncio.wait_for(asyncio.to_thread(self._delete), self.call_timeout)
        self.log.warning("[rayslice] the setup was stopped while waiting: %s %s", self._what(), outcome)

    # ---- per resource

    def _what(self) -> str:
        raise NotImplementedError

    def _look(self) -> tuple[dict[str, Any] | None, str]:
        """(what the operator returns, "") once ready, else (None, why not yet); raises when it failed."""
        raise NotImplementedError

    def _late(self, why: str) -> str:
        raise NotImplementedError

    def _delete(self) -> str:
        raise NotImplementedError

    @staticmethod
    def _close(client: Any) -> None:
        close = getattr(client, "close", None)
        if close is not None:
            close()


class RayClusterReadyTrigger(_SetupTrigger):
    """Until the RayCluster ``ref`` (a `ClusterRef`'s fields) is ready; the event carries its dashboard URL."""

    def __init__(self, *, ref: dict[str, Any], token_secret: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ref = ref
        self.token_secret = token_secret

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"ref": self.ref, "token_secret": self.token_secret, **self._kwargs()})

    def _kube(self) -> Any:
        from rayslice.cloud.kuberay_client import ClusterRef, KubeRayClient

        if self._client is None:
            self._client = KubeRayClient(ClusterRef(**self.ref))
        return self._client

    def _what(self) -> str:
        return f"RayCluster {self.ref.get('namespace', 'default')}/{self.ref['name']}"

    def _look(self) -> tuple[dict[str, Any] | None, str]:
        kube = self._kube()
        url, why = kube.ready_url()
        if url is None:
            return None, why
        return {"namespace": kube.ref.namespace, "name": kube.ref.name, "dashboard_url": url}, ""

    def _late(self, why: str) -> str:
        from rayslice.cloud.kuberay_client import not_ready_in_time

        return str(not_ready_in_time(self._kube().ref, self.timeout, why))

    def _delete(self) -> str:
        kube = self._kube()
        outcome = kube.delete(owner=self.owner)
        if self.token_secret:
            secret = kube.delete_token_secret(self.token_secret, owner=self.owner)
            outcome += f"; its token Secret {self.token_secret}: {secret}"
        return outcome


class QueuedSliceActiveTrigger(_SetupTrigger):
    """Until the queued resource ``queued`` (a `QueuedSlice`'s fields) is ACTIVE."""

    def __init__(self, *, queued: dict[str, Any], api_endpoint: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.queued = queued
        self.api_endpoint = api_endpoint

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"queued": self.queued, "api_endpoint": self.api_endpoint, **self._kwargs()})

    def _slices(self) -> Any:
        from rayslice.cloud.cloud_tpu import QueuedSlice, QueuedSliceClient

        if self._client is None:
            self._client = QueuedSliceClient(QueuedSlice(**self.queued), api_endpoint=self.api_endpoint)
        return self._client

    def _what(self) -> str:
        return f"queued resource {self.queued['queued_resource_id']}"

    def _look(self) -> tuple[dict[str, Any] | None, str]:
        client = self._slices()
        active, state = client.active_state()
        if active is None:
            return None, state
        return {"name": client.queued.name, "tpu": client.queued.tpu, "num_slices": str(client.queued.num_slices)}, ""

    def _late(self, why: str) -> str:
        return str(self._slices().not_active_in_time(self.timeout, why))

    def _delete(self) -> str:
        return self._slices().delete(owner=self.owner, wait=False)

    @staticmethod
    def _close(client: Any) -> None:
        transport = getattr(getattr(client, "client", None), "transport", None)
        if transport is not None:
            transport.close()
