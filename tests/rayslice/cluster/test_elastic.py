"""Elastic slice counts on the session cluster's two v6e-16: start on one, grow to two, resume on one after a loss.

One step, `num_slices=(1, 2)`, trains with `fit(global_rows=...)` (the same global batch on any
slice count), checkpointing every step. While a fixed one-slice step holds the other slice, it
starts on one slice after `elastic_wait`; when that step ends, the queue offers it the free slice,
and it checkpoints and resumes on two; when a host of one of its slices is lost, it resumes on the
slice left. It must end where a fixed 2-slice run of the same training ends (`reference_fit`: the same
training in numpy, which a `global_rows` run matches on any device count; tests/dags/test_resharding.py),
and hold nothing after. The training is `fed_fit` (tests/fed_training.py: `fit`, paced by the test
rather than a clock): it holds after a saved step, so the offer and the loss reach an attempt the
test has seen running, and it is let go as soon as the last attempt started.
The lost host is started again at the end (as tests/rayslice/cluster/test_notices.py does), so the
session cluster keeps its two slices and no cluster of its own has to start.
"""

from __future__ import annotations  # noqa: I001  (tests.airflow_env must come before airflow)

import tests.airflow_env  # noqa: F401  (the numpy reference imports the example DAG, which imports Airflow)
import os
import re
import tempfile
import threading
import time
from pathlib import Path

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster
from tests.conftest import wait_until
from tests.fed_training import Feed, fed_fit
from tests.rayslice.cluster.test_preemption import free_chips_match_alive_hosts, run_as_job
from tests.training_reference import assert_matches, reference_fit

DATASET = {"features": 4, "rows_per_device": 8, "seed": 7}
GLOBAL_ROWS = 64  # divisible by 16 and 32 devices: every slice count sees the same batch
#: More steps than the attempts before the last one run (the last one resumes after step 3, the rest at once).
STEPS = 16
LEARNING_RATE = 0.05


def hold_until_released(folder: str):
    """A fixed one-slice step: marks its slice, then holds it until the test lets it go."""
    import os
    import time

    Path(folder, f"held-{os.environ['TPU_NAME']}").touch()
    while not Path(folder, "release").exists():
        time.sleep(0.1)
    return os.environ["TPU_NAME"]


def elastic_training(folder: str, feed: str, dataset: dict, learning_rate: float, steps: int, global_rows: int):
    """Notes each attempt's slice count and devices (and its slice), then trains (`fit`'s training, fed)."""
    import os

    import jax

    from rayslice import get_step_context

    context = get_step_context()
    Path(folder, f"attempt{context.preemption_attempt}-slices{context.num_slices}-devices{jax.device_count()}-"
                 f"{os.environ['TPU_NAME']}-{jax.process_index()}").touch()
    result = fed_fit(feed, dataset, learning_rate, steps, checkpoint_every=1, global_rows=global_rows)
    return {**result, "devices": jax.device_count(), "slices": context.num_slices}


def attempts(folder: str) -> dict[int, set[tuple[int, int, str]]]:
    """attempt -> {(slices, devices, slice name)} its processes noted."""
    seen: dict[int, set[tuple[int, int, str]]] = {}
    for name in os.listdir(folder):
        if m := re.fullmatch(r"attempt(\d+)-slices(\d+)-devices(\d+)-(.+)-\d+", name):
            seen.setdefault(int(m[1]), set()).add((int(m[2]), int(m[3]), m[4]))
    return seen


def saved_steps(root: Path) -> list[int]:
    """The steps whose checkpoint the training saved under `root` (orbax: one folder per step)."""
    return sorted(int(p.name) for p in root.rglob("*") if p.is_dir() and p.name.isdigit())


def test_an_elastic_step_starts_on_one_grows_to_two_and_resumes_on_one_after_a_loss(cluster, tmp_path):
    owner = dict(dag_id="elastic", task_id="train")
    lost: list[int] = []  # the session cluster's node this test kills, started again at the end
    feed = Feed(tmp_path / "feed")
    feed.release(1)  # the first attempt trains step 0, saves it, and waits, running
    try:
        with tempfile.TemporaryDirectory() as folder:
            blocker = StepSpec.for_function(hold_until_released, request=TpuSliceRequest(tpu="v6e-16"),
                                            kwargs={"folder": folder}, owner=Owner(run_id=f"blocker-{time.time_ns()}"))
            held: dict[str, object] = {}
            holding = threading.Thread(target=lambda: held.setdefault("result", run_as_job(cluster, blocker)))
            holding.start()
            assert wait_until(lambda: any(n.startswith("held-") for n in os.listdir(folder)), timeout=180)
            blocked_slice = next(n for n in os.listdir(folder) if n.startswith("held-")).removeprefix("held-")

            log: list[str] = []
            checkpoints = tmp_path / "elastic"
            step = StepSpec.for_function(
                elastic_training,
                request=TpuSliceRequest(tpu="v6e-16", num_slices=(1, 2), multislice=True, elastic_wait=3),
                kwargs=dict(folder=folder, feed=feed.path, dataset=DATASET, learning_rate=LEARNING_RATE, steps=STEPS,
                            global_rows=GLOBAL_ROWS),
                preemption_retries=1, checkpoint_root=checkpoints.as_uri(),
                owner=Owner(run_id=f"elastic-{time.time_ns()}", **owner))
            outcome: dict[str, object] = {}

            def run_elastic() -> None:
                import asyncio

                from rayslice.client.submission import run_step_job

                try:
                    outcome["result"] = asyncio.run(run_step_job(cluster.dashboard_url, step, token=cluster.token,
                                                                 emit=log.append))
                except BaseException as exc:  # reported by the test below
                    outcome["error"] = exc

            running = threading.Thread(target=run_elastic)
            running.start()
            # 1. One slice is busy: after elastic_wait it starts on the other one.
            assert wait_until(lambda: 0 in attempts(folder), timeout=240), log[-20:]
            assert {(s, d) for s, d, _ in attempts(folder)[0]} == {(1, 16)}
            assert blocked_slice not in {name for _, _, name in attempts(folder)[0]}
            # 2. A step trained (and saved) on one slice, and the training waits, running: the other slice frees,
            # it is offered it, checkpoints, and resumes on both.
            assert wait_until(lambda: feed.waiting(0, 1), timeout=120), log[-20:]
            assert saved_steps(checkpoints)
            Path(folder, "release").touch()
            holding.join(timeout=120)
            assert held.get("result") == [blocked_slice] * 4
            assert wait_until(lambda: 1 in attempts(folder), timeout=240), log[-20:]
            assert {(s, d) for s, d, _ in attempts(folder)[1]} == {(2, 32)}
            # 3. Once a step trained on both is saved, a host of one of its slices is lost: it resumes on the
            # slice left, without waiting for another.
            resumed_from = max(saved_steps(checkpoints))
            feed.release(resumed_from + 1)
            assert wait_until(lambda: feed.waiting(1, resumed_from + 1), timeout=120), log[-20:]
            assert max(saved_steps(checkpoints)) > resumed_from
            lost.append(next(i for i, n in enumerate(cluster.nodes)
                             if n.slice_name == blocked_slice and n.worker_id == 1))
            local_cluster.kill_node(cluster, lost[0])
            with feed.releasing(lambda: feed.started(2), STEPS):
                running.join(timeout=400)
            assert "error" not in outcome, outcome.get("error")
            assert wait_until(lambda: 2 in attempts(folder), timeout=1)
            assert {(s, d) for s, d, _ in attempts(folder)[2]} == {(1, 16)}
            assert blocked_slice not in {name for _, _, name in attempts(folder)[2]}

        text = "\n".join(log)
        assert "elastic: starting on 1 of 1-2 x v6e-16" in text
        assert "more v6e-16 free and nobody waits for it" in text
        assert "no preemption retry used" in text
        assert "retrying the whole gang (1 of 1)" in text
        results = outcome["result"]
        assert {r["devices"] for r in results} == {16}  # the last attempt: one slice's 4 hosts
        assert all(0 < r["resumed_from"] < STEPS for r in results)
        assert_matches(results, reference_fit(DATASET, LEARNING_RATE, STEPS, global_rows=GLOBAL_ROWS))
        assert wait_until(lambda: free_chips_match_alive_hosts(cluster), timeout=10)
    finally:
        feed.release(STEPS)  # a failed test leaves no training waiting on the session cluster
        if lost:
            local_cluster.restart_node(cluster, lost[0])
