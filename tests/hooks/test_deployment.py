"""The first steps of a fresh Airflow, started at once, agree on its deployment id (issue 36, item 8).

The Task SDK's `Variable.set` overwrites, with no create-if-absent: each first step finds no
`rayslice_deployment` Variable and sets an id of its own. A step that went on with its own id would
stamp its job with a losing id (retries would not stop it, `rayslice reap` would skip it, its
checkpoints would land in another folder).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import airflow.sdk
from rayslice.hooks import ray as ray_hook
from rayslice.hooks.ray import RayHook


class Variables:
    """Airflow's Variables as the Task SDK sees them: reads and overwriting writes; both steps read first."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.first_reads = threading.Barrier(2)

    def get(self, key: str, default=None):
        if key not in self.values:
            try:
                self.first_reads.wait(timeout=5)  # both first steps find no Variable
            except threading.BrokenBarrierError:
                pass
        return self.values.get(key, default)

    def set(self, key: str, value: str, description: str | None = None) -> None:
        if threading.current_thread().name == "second":
            time.sleep(0.3)  # the second step's write lands after the first step's read-back would have
        self.values[key] = value


def test_steps_that_create_the_deployment_id_at_once_all_use_the_same(monkeypatch):
    variables = Variables()
    monkeypatch.setattr(airflow.sdk, "Variable", variables)
    monkeypatch.setattr(RayHook, "settings", lambda self: SimpleNamespace(deployment=None))
    monkeypatch.setattr(ray_hook, "DEPLOYMENT_SETTLE_S", 1.0, raising=False)
    ids: dict[str, str] = {}

    def first_step() -> None:
        ids[threading.current_thread().name] = RayHook().deployment()

    steps = [threading.Thread(target=first_step, name=name) for name in ("first", "second")]
    for step in steps:
        step.start()
    for step in steps:
        step.join(timeout=30)
    assert ids["first"] == ids["second"] == variables.values["rayslice_deployment"], ids
