"""`fit` paced by the test instead of a clock: the hosts wait, together, for the test to release steps.

`dags/training_pipeline.py:fit(..., seconds_per_step=s)` sleeps `s` after each step so that a notice
(a drain, a higher-priority step, an offer to grow) or a host loss comes while it runs. That is a
hope (a loaded machine may let the run finish first) and, after the event, pure waiting (every
step left sleeps). `fed_fit` is `fit` with that sleep replaced by a wait on a feed (as
tests/e2e/dags/shared_day.py's training has): step `i` runs once the test released more than `i`
steps (`Feed.release`). While it waits, the lead process notes where (`Feed.waiting`), so the test
injects its event into a training it *knows* is mid-run, and then releases the rest at once.

Everything else is `fit`'s: the same batches (`batch`, `process_block`), the same jitted step, the
same orbax checkpoints and notice handling (a host that heard a notice makes every host checkpoint
the step it has just completed and raise `StepSuspended`), the same result. So
`tests/training_reference.py:reference_fit` is what it must end with, as for `fit`. A notice that
comes while the hosts wait ends the wait (unless `heed_notice=False`), as it would end `fit`'s
sleep: the step after it runs, and the check after it suspends. (`fit` itself still runs on a
cluster, notices and slice changes included, in tests/dags/test_training_pipeline.py and
tests/dags/test_resharding.py.)
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from pathlib import Path

#: The file under the feed folder that says how many steps the training may have done.
RELEASED = "released"


def fed_fit(feed: str, dataset: dict, learning_rate: float, steps: int, checkpoint_every: int = 2,
            heed_notice: bool = True, global_rows: int | None = None) -> dict:
    """`fit(dataset, learning_rate, steps, checkpoint_every, heed_notice=..., global_rows=...)`, paced by `feed`.

    Before step `i` every host waits until the feed folder's `released` says more than `i` (or,
    heeding notices, until a host heard one); the lead notes `waiting-attempt{A}-step{i}` there
    while it waits, and `started-attempt{A}-from{start}` when an attempt starts.
    """
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from rayslice.dags.training_pipeline import batch, process_block

    from rayslice import StepSuspended, get_step_context

    context = get_step_context()
    lead = jax.process_index() == 0
    folder = Path(feed)

    def any_host_noticed() -> bool:  # every host must stop at the same step: the checkpoint save is collective
        flag = np.array([int(context.preempted)], dtype=np.int32)
        return bool(np.asarray(multihost_utils.process_allgather(flag)).any()) if jax.process_count() > 1 \
            else bool(flag[0])

    def wait_for_feed(i: int) -> None:
        """Until the test released step `i` or (heeding notices) a host heard one; every host leaves in the same round.

        Each round all-gathers the lead's view of the feed and every host's notice flag, so no host
        starts the step (a collective) while another still waits.
        """
        noted = False
        while True:
            released = int((folder / RELEASED).read_text() or 0) if lead and (folder / RELEASED).exists() else 0
            flags = np.array([int(heed_notice and context.preempted), released], dtype=np.int32)
            if jax.process_count() > 1:
                flags = np.asarray(multihost_utils.process_allgather(flags)).reshape(-1, 2)
            flags = flags.reshape(-1, 2)
            if flags[:, 0].any() or flags[:, 1].max() > i:
                return
            if lead and not noted:
                (folder / f"waiting-attempt{context.preemption_attempt}-step{i}").touch()
                noted = True
            time.sleep(0.2)

    # From here on, `fit`'s body, with `time.sleep(seconds_per_step)` replaced by `wait_for_feed`.
    if global_rows is not None and (global_rows <= 0 or global_rows % jax.device_count()):
        raise ValueError(f"global_rows={global_rows} must be a positive multiple of the {jax.device_count()} "
                         f"devices of this run ({jax.process_count()} process(es)), so every device gets as many rows")
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = dataset["rows_per_device"] * jax.local_device_count()
    by_row, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

    def global_batch(i: int):
        if global_rows is None:
            x, y = batch(dataset, i, rows, jax.process_index())
            return (jax.make_array_from_process_local_data(by_row, x),
                    jax.make_array_from_process_local_data(by_row, y))
        x, y = process_block(dataset, i, global_rows, jax.process_index(), jax.process_count())
        return (jax.make_array_from_process_local_data(by_row, x, (global_rows, dataset["features"])),
                jax.make_array_from_process_local_data(by_row, y, (global_rows,)))

    def loss_of(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    @jax.jit
    def train_step(w, x, y):
        loss, grad = jax.value_and_grad(loss_of)(w, x, y)
        return w - learning_rate * grad, loss

    w = jax.device_put(jnp.zeros(dataset["features"], dtype=jnp.float32), replicated)
    manager = None
    start = 0
    if context.checkpoint_path:
        manager = ocp.CheckpointManager(
            context.checkpoint_path,
            options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False),
        )
        if manager.latest_step() is not None:
            start = manager.latest_step()
            w = manager.restore(start, args=ocp.args.StandardRestore({"w": w}))["w"]
            print(f"resumed from step {start} (preemption attempt {context.preemption_attempt}, "
                  f"try {context.try_number})", flush=True)
    if lead:
        (folder / f"started-attempt{context.preemption_attempt}-from{start}").touch()
    for i in range(start, steps):
        wait_for_feed(i)
        w, loss = train_step(w, *global_batch(i))
        print(f"step {i}: loss {float(loss):.6f}", flush=True)
        if manager and (i + 1) % checkpoint_every == 0:
            manager.save(i + 1, args=ocp.args.StandardSave({"w": w}))
        if manager and heed_notice and i + 1 < steps and any_host_noticed():
            if manager.latest_step() != i + 1:
                manager.save(i + 1, args=ocp.args.StandardSave({"w": w}), force=True)
            manager.wait_until_finished()
            print(f"preemption notice: checkpointed step {i + 1} of {steps}; stopping", flush=True)
            raise StepSuspended(f"checkpointed step {i + 1} for a preemption notice")
    if manager:
        if manager.latest_step() != steps:
            manager.save(steps, args=ocp.args.StandardSave({"w": w}), force=True)
        manager.wait_until_finished()
    final = float(jax.jit(loss_of)(w, *global_batch(steps)))
    result = {
        "loss": final,
        "weights": [float(v) for v in np.asarray(jax.device_get(w))],
        "checkpoint": f"{context.checkpoint_dir}/{steps}" if context.checkpoint_dir else None,
    }
    if global_rows is not None:
        result |= {"resumed_from": start, "devices": jax.device_count()}
    return result


class Feed:
    """The test's side of `fed_fit`'s feed: a folder the training's hosts can read (the session cluster's are local)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = str(self.folder)

    def release(self, steps: int) -> None:
        """Let the training run until it has done `steps` steps (never fewer than already released)."""
        partial = self.folder / f"{RELEASED}.partial"
        partial.write_text(str(max(steps, self.released())))
        os.replace(partial, self.folder / RELEASED)  # the hosts read a whole number or none

    def released(self) -> int:
        path = self.folder / RELEASED
        return int(path.read_text() or 0) if path.exists() else 0

    def waiting(self, attempt: int, step: int | None = None) -> bool:
        """Whether the training's attempt `attempt` waited (at step `step`) for the test: it is running, held there."""
        names = os.listdir(self.folder)
        return any(m and int(m[1]) == attempt and (step is None or int(m[2]) == step)
                   for m in (re.fullmatch(r"waiting-attempt(\d+)-step(\d+)", n) for n in names))

    def started(self, attempt: int) -> bool:
        """Whether attempt `attempt` started (and read its checkpoint)."""
        return any(n.startswith(f"started-attempt{attempt}-from") for n in os.listdir(self.folder))

    @contextlib.contextmanager
    def releasing(self, condition, steps: int, timeout: float = 300):
        """Release `steps` once `condition()` holds (a thread's wait); at the latest after `timeout` or the block.

        So a step the test held is let go right after the event it was held for, and a test that fails
        before that event never leaves a training waiting on the session cluster.
        """
        from tests.conftest import wait_until

        done = threading.Event()

        def release_when_ready() -> None:
            wait_until(lambda: done.is_set() or condition(), timeout=timeout, interval=0.1)
            self.release(steps)

        thread = threading.Thread(target=release_when_ready, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            done.set()
            thread.join()
