"""A trigger that measures the triggerer's event-loop lag from inside the loop (bench/airflow_concurrency.py).

It sleeps `interval` seconds in a loop and records how much later than asked each sleep
returned: the time the loop was busy with other triggers (or blocked). Samples go to a JSON
lines file, so the benchmark reads them without Airflow's APIs; the probe ends when a
`<path>.stop` file appears (or after `max_seconds`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.sdk import BaseOperator
from airflow.triggers.base import BaseTrigger, TriggerEvent


class LagProbeTrigger(BaseTrigger):
    def __init__(self, path: str, interval: float = 0.05, max_seconds: float = 900.0) -> None:
        super().__init__()
        self.path, self.interval, self.max_seconds = path, float(interval), float(max_seconds)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"path": self.path, "interval": self.interval, "max_seconds": self.max_seconds})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        loop = asyncio.get_running_loop()
        end = loop.time() + self.max_seconds
        batch: list[tuple[float, float]] = []
        flushed = loop.time()
        while loop.time() < end and not os.path.exists(self.path + ".stop"):
            before = loop.time()
            await asyncio.sleep(self.interval)
            batch.append((time.time(), loop.time() - before - self.interval))
            if loop.time() - flushed >= 1.0:  # one small append a second
                self._flush(batch)
                batch, flushed = [], loop.time()
        self._flush(batch)
        yield TriggerEvent({"status": "done"})

    def _flush(self, batch: list[tuple[float, float]]) -> None:
        if batch:
            with open(self.path, "a") as out:
                out.write("".join(json.dumps(sample) + "\n" for sample in batch))


class LagProbeOperator(BaseOperator):
    """Defers at once to a LagProbeTrigger (holds no worker slot while it measures)."""

    template_fields = ("path",)

    def __init__(self, *, path: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = path

    def execute(self, context: Any) -> None:
        self.defer(trigger=LagProbeTrigger(self.path), method_name="execute_complete")

    def execute_complete(self, context: Any, event: dict[str, Any]) -> str:
        return event["status"]
