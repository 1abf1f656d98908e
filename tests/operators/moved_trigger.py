"""Killing a deferred setup's trigger as Airflow does when the trigger only moved to another triggerer."""

from __future__ import annotations

import asyncio

import pytest


def kill_while_still_deferred(trigger, monkeypatch: pytest.MonkeyPatch) -> None:
    """`on_kill()` while Airflow says the task is still deferred: the trigger moved, the task was not killed."""
    from rayslice.operators import setup_triggers

    async def still_deferred(*args, **kwargs):
        return "deferred"

    with monkeypatch.context() as patch:
        patch.setattr(setup_triggers, "task_state", still_deferred)
        asyncio.run(trigger.on_kill())
